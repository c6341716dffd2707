"""Bench part (s) without a GPU: `--fresh-caches` starts each variant on empty compile caches of its own, each pair
of runs (one GPU, N GPUs, each checkpoint of the checkpoint sweep) is compared with lm-eval once both are done, and
an unknown variant is refused first."""

import json
from pathlib import Path

import pytest

import benchmarks.suite_8b as suite_8b
from benchmarks.common import fresh_caches
from benchmarks.suite_8b import Suite, gpu_env

CACHE_VARIABLES = {"VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"}


def test_fresh_caches_are_empty_folders_of_their_own_even_after_an_earlier_run(tmp_path):
    folder = tmp_path / "caches" / "raysweep_1"
    left = folder / "vllm" / "torch_compile_cache" / "artefact"
    left.parent.mkdir(parents=True)
    left.write_text("compiled by an earlier run")

    env = fresh_caches(folder)

    assert set(env) == CACHE_VARIABLES
    paths = [Path(value) for value in env.values()]
    assert len(set(paths)) == len(paths)
    assert all(path.is_dir() and not any(path.iterdir()) and path.parent == folder for path in paths)
    assert not left.exists()


def test_each_variant_gets_its_own_caches_and_a_checkpoint_loop_shares_its_variants(tmp_path, monkeypatch):
    calls = []

    def run_process(argv, env, stem):
        calls.append((stem.name, env))
        return 10.0, ""

    monkeypatch.setattr(suite_8b, "run_process", run_process)
    models, tasks = [tmp_path / "model-1", tmp_path / "model-2"], tmp_path / "tasks"

    Suite(tmp_path, "vllm").lm_eval("lm_eval_1", models[:1], tasks, 1)
    assert calls.pop()[1] == gpu_env(1)  # without the flag: the machine's own caches

    suite = Suite(tmp_path, "vllm", fresh=True)
    suite.lm_eval("lm_eval_1", models[:1], tasks, 1)
    suite.lm_eval("lm_eval_ckpt", models, tasks, 4)

    (_, one), (_, first), (_, second) = calls
    assert one["CUDA_VISIBLE_DEVICES"] == "0" and first["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert first == second
    assert {one[k] for k in CACHE_VARIABLES}.isdisjoint(first[k] for k in CACHE_VARIABLES)
    assert Path(one["VLLM_CACHE_ROOT"]).is_relative_to(tmp_path / "caches" / "lm_eval_1")


def test_each_tools_own_environment_goes_to_it_alone(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(suite_8b, "run_process", lambda argv, env, stem: calls.append(env) or (10.0, ""))
    monkeypatch.setattr(suite_8b, "spec_file", lambda *args: tmp_path / "spec.yaml")
    monkeypatch.setattr(suite_8b, "token_counts", lambda output: {})
    suite = Suite(tmp_path, "vllm", peer_env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
                  own_env={"RAYSWEEP_WEIGHT_SWAP": "0"})

    suite.lm_eval("lm_eval_1", [tmp_path / "model-1"], tmp_path / "tasks", 1)
    suite.raysweep("raysweep_1", [tmp_path / "model-1"], tmp_path / "tasks", 1)

    theirs, ours = calls
    assert theirs == {**gpu_env(1), "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert ours == {**gpu_env(1), "RAYSWEEP_WEIGHT_SWAP": "0"}


def test_each_pair_is_compared_once_both_its_runs_are_done(tmp_path, monkeypatch):
    runs, compared = [], []

    def prepare(out, fraction, seeds, shape):
        return out / "tasks", [out / f"model-{seed}" for seed in seeds]

    def run(tool):
        def record(self, name, models, tasks, gpus, only=None):
            runs.append((name, gpus) if only is None else (name, gpus, only))
            self.figures[name] = 10.0 if tool == "raysweep" else 30.0
            return self.figures[name]
        return record

    def agreement(ours, theirs):
        compared.append((ours.relative_to(tmp_path).as_posix(), theirs.name, [run[0] for run in runs]))
        return {"mmlu": {"documents": 1}, "metrics": {}}

    monkeypatch.setattr(suite_8b, "prepare", prepare)
    monkeypatch.setattr(suite_8b, "agreement", agreement)
    monkeypatch.setattr(Suite, "raysweep", run("raysweep"))
    monkeypatch.setattr(Suite, "lm_eval", run("lm_eval"))

    suite_8b.main(["--out", str(tmp_path), "--gpus", "2", "--variants", "raysweep_1,raysweep_n,lm_eval_1,lm_eval_n"])

    assert runs == [("raysweep_1", 1), ("raysweep_n", 2), ("lm_eval_1", 1), ("lm_eval_n", 2)]
    assert compared == [("raysweep_1_out/lm_eval", "lm_eval_1", ["raysweep_1", "raysweep_n", "lm_eval_1"]),
                        ("raysweep_n_out/lm_eval", "lm_eval_n", ["raysweep_1", "raysweep_n", "lm_eval_1", "lm_eval_n"])]
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["agreement"] == figures["agreement_n"] == {"mmlu": {"documents": 1}, "metrics": {}}
    assert figures["lm_eval_1/raysweep_1"] == figures["lm_eval_n/raysweep_n"] == 3.0

    runs.clear()  # the checkpoint sweep: each checkpoint's records against lm-eval's run of it
    compared.clear()
    suite_8b.main(["--out", str(tmp_path), "--gpus", "4", "--variants", "", "--checkpoints", "3"])

    assert runs == [("raysweep_ckpt", 4), ("lm_eval_ckpt", 4, [1, 2, 3])]
    assert [(ours, theirs) for ours, theirs, _ in compared] == [
        (f"raysweep_ckpt_out/lm_eval/model-{k}", f"lm_eval_ckpt_{k - 1}") for k in (1, 2, 3)]
    figures = json.loads((tmp_path / "s.json").read_text())
    assert {f"agreement_ckpt_{k}" for k in (1, 2, 3)} | {f"nearest_ckpt_{k}" for k in (1, 2, 3)} <= set(figures)
    assert figures["lm_eval_ckpt/raysweep_ckpt"] == 3.0

    runs.clear()  # lm-eval on some checkpoints only: those compared, no ratio
    compared.clear()
    (tmp_path / "s.json").unlink()
    suite_8b.main(["--out", str(tmp_path), "--gpus", "1", "--variants", "", "--checkpoints", "4", "--ckpt-lm-eval", "4"])

    assert runs == [("raysweep_ckpt", 1), ("lm_eval_ckpt", 1, [4])]
    assert [(ours, theirs) for ours, theirs, _ in compared] == [("raysweep_ckpt_out/lm_eval/model-4", "lm_eval_ckpt_3")]
    figures = json.loads((tmp_path / "s.json").read_text())
    assert {f"nearest_ckpt_{k}" for k in (1, 2, 3, 4)} <= set(figures) and "lm_eval_ckpt/raysweep_ckpt" not in figures

    runs.clear()  # lm-eval on none: raysweep's checkpoints against each other alone
    compared.clear()
    (tmp_path / "s.json").unlink()
    suite_8b.main(["--out", str(tmp_path), "--gpus", "1", "--variants", "", "--checkpoints", "2", "--ckpt-lm-eval", "none"])

    assert runs == [("raysweep_ckpt", 1)] and compared == []
    figures = json.loads((tmp_path / "s.json").read_text())
    assert {"nearest_ckpt_1", "nearest_ckpt_2"} <= set(figures) and "lm_eval_ckpt/raysweep_ckpt" not in figures


def _records(folder: Path, task: str, values: list[list[float]]) -> Path:
    """lm-eval's sample file of `task`, one document per list of choice values."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"samples_{task}_2026-12-01T00-00-00.jsonl", "w") as f:
        for doc, choices in enumerate(values):
            f.write(json.dumps({"doc_id": doc, "filter": "none", "filtered_resps": [[v, False] for v in choices]}) + "\n")
    return folder


def test_each_checkpoints_documents_are_matched_to_the_lm_eval_run_nearest_them(tmp_path):
    """A checkpoint's rows that came from another checkpoint's engine lie within bf16 noise of that one's lm-eval
    run; rows of neither lie within SAME_MODEL of none."""
    theirs = [_records(tmp_path / f"lm_eval_ckpt_{k}", "hellaswag", [[-10.0 - k, -12.0 - k]] * 3) for k in (0, 1)]
    ours = _records(tmp_path / "ours", "hellaswag", [[-11.0005, -13.0], [-10.0, -11.9995], [-10.5, -12.5]])

    found = suite_8b.nearest_runs(ours, theirs)

    assert found["hellaswag"] == {"lm_eval_ckpt_0": 1, "lm_eval_ckpt_1": 1, "none": 1}
    assert found["mmlu"] == {"lm_eval_ckpt_0": 0, "lm_eval_ckpt_1": 0, "none": 0}  # no records of it


def test_a_variant_it_does_not_know_is_refused_before_anything_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        suite_8b.main(["--out", str(tmp_path / "out"), "--variants", "raysweep_1,raysweep_4"])
    assert "--variants: some of raysweep_1, lm_eval_1, raysweep_n, lm_eval_n; got 'raysweep_1,raysweep_4'" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        suite_8b.main(["--out", str(tmp_path / "out"), "--checkpoints", "4", "--ckpt-lm-eval", "5"])
    assert "--ckpt-lm-eval: checkpoint numbers 1 to 4, comma separated; got '5'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_each_engine_start_is_one_line_with_the_shards_of_each_model_that_ran_on_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from benchmarks.common import engine_lives

    from datetime import datetime, timedelta

    at = [datetime(2026, 12, 1) + timedelta(seconds=s) for s in range(10)]
    (tmp_path / "telemetry").mkdir()
    start = {"actor_id": "0123456789", "profile": "short", "compile_s": None, "weights_s": None}
    pq.write_table(pa.Table.from_pylist([
        {**start, "start_index": 0, "model": "ckpt-1", "reason": "first", "startup_s": 20.04, "compile_s": 4.0,
         "ready_at": at[1]},
        {**start, "start_index": 1, "model": "ckpt-2", "reason": "weights", "startup_s": 2.5, "weights_s": 2.44,
         "ready_at": at[5]},
        {**start, "actor_id": "abcdefghij", "start_index": 0, "model": "ckpt-1", "reason": "first", "startup_s": 20.0,
         "ready_at": at[0]}]),
        tmp_path / "telemetry" / "actors.parquet")
    shard = {"actor_id": "0123456789", "error": None}
    pq.write_table(pa.Table.from_pylist([  # the shards' telemetry: the actor and when each started there
        {**shard, "started_at": at[2], "model": "ckpt-1"}, {**shard, "started_at": at[4], "model": "ckpt-1"},
        {**shard, "started_at": at[6], "model": "ckpt-2"}, {**shard, "started_at": at[5], "model": "ckpt-1"},
        {**shard, "started_at": at[7], "model": "ckpt-2", "error": "raised"},
        {**shard, "actor_id": "abcdefghij", "started_at": at[8], "model": "ckpt-1"}]),
        tmp_path / "telemetry" / "shards.parquet")

    assert engine_lives(tmp_path) == [
        "01234567 #0 ckpt-1 (first, short): up in 20.0 s, compile 4.0 s, weights - s; shards {'ckpt-1': 2}",
        "01234567 #1 ckpt-2 (weights, short): up in 2.5 s, compile - s, weights 2.4 s; shards {'ckpt-2': 1, 'ckpt-1': 1}",
        "abcdefgh #0 ckpt-1 (first, short): up in 20.0 s, compile - s, weights - s; shards {'ckpt-1': 1}"]
    assert engine_lives(tmp_path / "nothing") == []
