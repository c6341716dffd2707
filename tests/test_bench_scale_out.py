"""Bench part (n) without a GPU: every variant runs against stub programs (a sweep's results, a script's JSON
summary, lm-eval's results file), the hand split starts one process per GPU, and the ratios come from the walls."""

import json
from pathlib import Path

import pytest

from benchmarks.common import Bench
from benchmarks.scale_out import VARIANTS, ScaleOut
from cluster.inputs.spec_file import load_spec
from test_bench_e2e import StubRunner


class Runner(StubRunner):
    """The e2e stub, plus lm-eval: a results file counting the documents it was given."""

    def __call__(self, argv, env, stem):
        if argv[2] == "lm_eval":
            limit = argv[argv.index("--limit") + 1] if "--limit" in argv else None
            data = Path(argv[argv.index("--include_path") + 1]).parent / "n_n12.jsonl"
            n = int(limit) if limit else sum(1 for _ in open(data))
            folder = Path(argv[argv.index("--output_path") + 1]) / "model"
            folder.mkdir(parents=True)
            (folder / "results_1.json").write_text(json.dumps({"n-samples": {"scale_gen": {"effective": n}}}))
            self.calls.append((stem.name, env))
            return 40.0, ""
        return super().__call__(argv, env, stem)


class Child:
    """A hand-split process: its summary printed to the file it was given at once."""
    started: list = []
    engines: list = []

    def __init__(self, argv, stdout, stderr, env, cwd):
        n = sum(1 for _ in open(argv[argv.index("--prompts") + 1]))
        stdout.write(json.dumps({"outputs": n, "output_tokens": n}) + "\n")
        stdout.close()
        Child.started.append((env["CUDA_VISIBLE_DEVICES"], n))
        Child.engines.append(json.loads(argv[argv.index("--engine-args") + 1]))

    def wait(self):
        return 0


def test_every_variant_runs_once_after_the_warm_ups_and_the_split_takes_one_gpu_each(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bench, runner = Bench("/models/small", tmp_path, 0), Runner()
    Child.started, Child.engines = [], []
    ScaleOut(bench, 4, 12, 8, runner=runner, popen=Child, tried_engines=[{"max_num_seqs": 8}]).run(list(VARIANTS),
                                                                                                  warm=True)
    names = [name for name, _ in runner.calls]
    assert names[:9] == ["n_warm_plain", "n_warm_plain_defaults", "n_warm_raysweep_1", "n_warm_raysweep",
                         "n_warm_raysweep_one", "n_warm_raysweep_two", "n_warm_raysweep_four", "n_warm_raysweep_tried",
                         "n_warm_lm_eval"]
    # the hand split, then the hand split given only the model: one process per GPU each time
    assert sorted(Child.started) == [("0", 3), ("0", 3), ("1", 3), ("1", 3), ("2", 3), ("2", 3), ("3", 3), ("3", 3)]
    assert "seed" in Child.engines[0] and Child.engines[4:] == [{"model": "/models/small"}] * 4
    envs = dict(runner.calls)
    assert envs["n_plain"] == envs["n_raysweep_1"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert envs["n_raysweep"] == envs["n_ray_data"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert "actors" not in json.loads((tmp_path / "n_raysweep.yaml").read_text())  # the rule chooses
    assert load_spec(tmp_path / "n_raysweep_two.yaml").actors.num_gpus == 0.5
    assert load_spec(tmp_path / "n_raysweep_one.yaml").actors.num_gpus == 1
    # each warm-up's engines are those of its variant: a whole GPU's engine arguments are not a shared one's
    assert "actors" not in json.loads((tmp_path / "n_warm_raysweep.yaml").read_text())
    assert load_spec(tmp_path / "n_warm_raysweep_four.yaml").actors.num_gpus == 0.25
    figures = json.loads((tmp_path / "n.json").read_text())
    assert set(figures["walls"]) == set(VARIANTS)
    values = {r["metric"]: r["value"] for r in bench.rows}
    assert values["RATIO plain/raysweep"] == pytest.approx(2.0)  # the stub's 20 s over 10 s
    assert values["RATIO plain/lm_eval"] == pytest.approx(0.5)
    walls = figures["walls"]  # the stub's split waits for nothing, its sweep 10 s
    assert values["RATIO split_defaults/raysweep"] == pytest.approx(walls["split_defaults"] / walls["raysweep"])


def test_the_plain_script_takes_raysweeps_arguments_or_only_the_model_and_the_gpus_are_this_process(
        tmp_path, monkeypatch):
    """`--engine` reaches raysweep's spec and the plain script alike; `plain_defaults` gives vLLM nothing but the
    model; with CUDA_VISIBLE_DEVICES=2,3 the one-GPU variants take GPU 2 and the split 2 and 3."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    runner = Runner()
    Child.started = []
    out = ScaleOut(Bench("/m", tmp_path, 0), 2, 12, 8, runner=runner, popen=Child, engine={"max_num_seqs": 1024})
    out.run(["plain", "plain_defaults", "split", "raysweep_1"], warm=False)
    assert runner.engines["n_plain_defaults"] == {"model": "/m"} and runner.engines["n_plain"]["max_num_seqs"] == 1024
    assert load_spec(tmp_path / "n_raysweep_1.yaml").models[0].engine["max_num_seqs"] == 1024
    assert dict(runner.calls)["n_raysweep_1"] == {"CUDA_VISIBLE_DEVICES": "2"}
    assert sorted(Child.started) == [("2", 6), ("3", 6)]
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES lists 2"):
        ScaleOut(Bench("/m", tmp_path, 0), 4, 12, 8, runner=runner, popen=Child)


def test_a_variant_that_misses_outputs_fails_the_bench(tmp_path):
    with pytest.raises(RuntimeError, match="11 outputs for 12 prompts"):
        ScaleOut(Bench("/m", tmp_path, 0), 2, 12, 8, runner=StubRunner(short_by=1)).run(["raysweep"], warm=False)


def test_rounds_run_every_variant_in_turn_and_the_walls_are_their_medians(tmp_path, monkeypatch):
    """`--rounds 3`: plain_defaults and raysweep alternate three times (a later round's prints named _r2, _r3),
    each wall is the median of its three, and each round's own ratio is said beside the medians'."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    walls = iter([30.0, 10.0, 20.0, 12.0, 25.0, 11.0])

    class Timed(Runner):
        def __call__(self, argv, env, stem):
            _, stdout = super().__call__(argv, env, stem)
            return next(walls), stdout

    bench, runner = Bench("/m", tmp_path, 0), Timed()
    ScaleOut(bench, 1, 12, 8, runner=runner, popen=Child, rounds=3).run(["plain_defaults", "raysweep"], warm=False)
    assert [name for name, _ in runner.calls] == ["n_plain_defaults", "n_raysweep", "n_plain_defaults_r2",
                                                  "n_raysweep_r2", "n_plain_defaults_r3", "n_raysweep_r3"]
    figures = json.loads((tmp_path / "n.json").read_text())
    assert figures["rounds"] == {"plain_defaults": [30.0, 20.0, 25.0], "raysweep": [10.0, 12.0, 11.0]}
    assert figures["walls"] == {"plain_defaults": 25.0, "raysweep": 11.0}
    ratio = next(r for r in bench.rows if r["metric"] == "RATIO plain_defaults/raysweep")
    assert ratio["value"] == pytest.approx(25 / 11) and "each round: 3.00, 1.67, 2.27" in ratio["unit"]


def test_a_tried_engine_setting_runs_beside_raysweeps_own_in_the_same_rounds(tmp_path, monkeypatch):
    """`--tried-engine JSON`: `raysweep_tried` is `raysweep`'s spec (the rule chooses its actors) with the setting
    on top of raysweep's engine arguments, warmed on its own (its compiled graphs are its own) and run in turn with
    the others; `raysweep` keeps its own arguments."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runner = Runner()
    ScaleOut(Bench("/m", tmp_path, 0), 1, 12, 8, runner=runner, popen=Child, raysweep_engine={"max_num_seqs": 256},
             tried_engines=[{"compilation_config": {"mode": 0}}], rounds=2).run(
        ["plain_defaults", "raysweep", "raysweep_tried"], warm=True)
    assert [name for name, _ in runner.calls] == [
        "n_warm_plain_defaults", "n_warm_raysweep", "n_warm_raysweep_tried", "n_plain_defaults", "n_raysweep",
        "n_raysweep_tried", "n_plain_defaults_r2", "n_raysweep_r2", "n_raysweep_tried_r2"]
    tried, own = (load_spec(tmp_path / f"n_{v}_r2.yaml").models[0].engine for v in ("raysweep_tried", "raysweep"))
    assert tried["compilation_config"] == {"mode": 0} and tried["max_num_seqs"] == own["max_num_seqs"] == 256
    assert "compilation_config" not in own
    assert load_spec(tmp_path / "n_warm_raysweep_tried.yaml").models[0].engine["compilation_config"] == {"mode": 0}
    assert "actors" not in json.loads((tmp_path / "n_raysweep_tried.yaml").read_text())


def test_tried_actors_give_raysweep_tried_its_own_actors_section(tmp_path, monkeypatch):
    """`--tried-actors JSON`: the tried setting may also choose the actors (one engine for the whole GPU with a
    larger batch, say), where `raysweep` keeps the rule's choice."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ScaleOut(Bench("/m", tmp_path, 0), 1, 12, 8, runner=Runner(), popen=Child, tried_engines=[{"max_num_seqs": 2048}],
             tried_actors={"num_gpus": 1}).run(["raysweep", "raysweep_tried"], warm=False)
    tried, own = (json.loads((tmp_path / f"n_{v}.yaml").read_text()) for v in ("raysweep_tried", "raysweep"))
    assert tried["actors"] == {"num_gpus": 1} and tried["models"][0]["engine"]["max_num_seqs"] == 2048
    assert "actors" not in own


def test_fresh_caches_give_every_run_empty_caches_of_its_own_and_leave_nothing_to_warm(tmp_path, monkeypatch):
    """`--fresh-caches`: each run, round after round, starts on empty caches under OUT/caches/STEM (a node new to
    the model); the hand split's processes share their run's, as one node's would; no warm-up runs."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runner, split = Runner(), []

    class NodeChild(Child):
        def __init__(self, argv, stdout, stderr, env, cwd):
            super().__init__(argv, stdout, stderr, env, cwd)
            split.append(env["VLLM_CACHE_ROOT"])

    ScaleOut(Bench("/m", tmp_path, 0), 2, 12, 8, runner=runner, popen=NodeChild, rounds=2, fresh=True).run(
        ["plain_defaults", "split", "raysweep"], warm=True)
    assert [name for name, _ in runner.calls] == ["n_plain_defaults", "n_raysweep", "n_plain_defaults_r2",
                                                  "n_raysweep_r2"]
    roots = [Path(env["VLLM_CACHE_ROOT"]) for _, env in runner.calls]
    assert roots[0] == tmp_path / "caches" / "n_plain_defaults" / "vllm" and len(set(roots)) == 4
    assert all(root.is_dir() and not any(root.iterdir()) for root in roots)
    assert len(split) == 4 and len(set(split)) == 2 and set(map(Path, split)).isdisjoint(roots)
    assert all(env["CUDA_VISIBLE_DEVICES"] for _, env in runner.calls)


def test_a_tried_variant_without_a_setting_or_a_setting_without_the_variant_is_refused(tmp_path, capsys):
    from benchmarks.scale_out import main

    for argv in (["--variants", "raysweep,raysweep_tried"], ["--variants", "raysweep", "--tried-engine", '{"a": 1}'],
                 ["--variants", "raysweep_tried,raysweep_tried2", "--tried-engine", '{"a": 1}'],
                 ["--variants", "raysweep_tried", "--tried-engine", '{"a": 1}', "--tried-engine", '{"b": 2}'],
                 ["--variants", "raysweep_tried", "--tried-engine", "{}"]):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path), "--gpus", "1", *argv])
        assert "each --tried-engine JSON (not empty) and its variant" in capsys.readouterr().err


def test_each_tried_engine_setting_is_a_variant_of_its_own_in_the_same_rounds(tmp_path, monkeypatch):
    """`--tried-engine` given twice: `raysweep_tried` and `raysweep_tried2`, each raysweep's spec with its own
    setting on top and the tried actors, warmed and run in turn with the others."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runner = Runner()
    ScaleOut(Bench("/m", tmp_path, 0), 1, 12, 8, runner=runner, popen=Child, tried_actors={"num_gpus": 1},
             tried_engines=[{"max_num_seqs": 2048}, {"max_num_seqs": 512, "seed": 3}]).run(
        ["raysweep", "raysweep_tried", "raysweep_tried2"], warm=True)
    assert [name for name, _ in runner.calls] == ["n_warm_raysweep", "n_warm_raysweep_tried", "n_warm_raysweep_tried2",
                                                  "n_raysweep", "n_raysweep_tried", "n_raysweep_tried2"]
    specs = {v: json.loads((tmp_path / f"n_{v}.yaml").read_text()) for v in ("raysweep_tried", "raysweep_tried2")}
    assert specs["raysweep_tried"]["models"][0]["engine"]["max_num_seqs"] == 2048
    assert specs["raysweep_tried2"]["models"][0]["engine"]["max_num_seqs"] == 512
    assert specs["raysweep_tried2"]["models"][0]["engine"]["seed"] == 3
    assert "seed" not in specs["raysweep_tried"]["models"][0]["engine"]
    assert all(spec["actors"] == {"num_gpus": 1} for spec in specs.values())
