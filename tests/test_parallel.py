"""Engines across GPUs and balanced tails, on CPUs: tensor/pipeline-parallel sizes in the spec,
the memory refusal before any engine starts, actors of N GPUs on one node of a fake multi-node cluster,
and shards cut at a model's tail committed exactly once."""

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from cluster.inputs.builtin_model import builtin_config, resolve_model_path
from cluster.contracts.model_memory import ACCELERATOR_MEMORY, config_parameters, refusal, weights
from cluster.contracts.errors import PreflightError
from cluster.inputs.checks import check_inputs
from cluster.contracts.spec import SpecError
from cluster.inputs.spec_file import load_spec
from cluster.schedule.tail_split import MIN_PART_ROWS

ROOT = Path(__file__).resolve().parents[1]
# Llama-3-70B's shapes (its config.json): 70.6B parameters
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "max_position_embeddings": 8192}


def write_spec(tmp_path, models: list[dict], rows: int = 40, actors: dict | None = None, max_samples: int = 10,
               name: str = "par") -> Path:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": f"s{i}", "text": f"sample {i}"}) + "\n"
                                              for i in range(rows)))
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name, "output": str(tmp_path / "out"), "models": models,
        "tasks": [{"name": "t", "data": "d.jsonl", "id_column": "id", "prompt": "{text}", "sampling": {"max_tokens": 2}}],
        "shards": {"max_samples": max_samples}, "actors": actors or {"count": 1, "num_cpus": 1}}))
    return tmp_path / f"{name}.yaml"


@pytest.mark.parametrize("engine, message", [
    ({"tensor_parallel_size": 0}, "engine.tensor_parallel_size: must be an integer from 1 to 16 (GPUs of one node), got 0"),
    ({"pipeline_parallel_size": "2"}, "engine.pipeline_parallel_size: must be an integer from 1 to 16 (GPUs of one node), got '2'"),
    ({"tensor_parallel_size": 32}, "engine.tensor_parallel_size: must be an integer from 1 to 16 (GPUs of one node), got 32"),
])
def test_parallel_sizes_are_checked_in_the_spec(tmp_path, engine, message):
    spec = write_spec(tmp_path, [{"name": "m", "path": "builtin:tiny", "engine": engine}])
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert str(err.value) == f"{spec}: models[0].{message}"


def test_an_engine_spans_tensor_times_pipeline_gpus(tmp_path):
    spec = load_spec(write_spec(tmp_path, [{"name": "m", "path": "builtin:tiny",
                                            "engine": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}]))
    assert spec.models[0].gpus_per_engine == 4


def test_parameters_from_safetensors_headers_equal_the_config_formula(model_cache):
    """The two ways of counting agree on a model at hand (builtin:tiny, tied embeddings), and the formula
    gives Llama-3-70B's published size."""
    path = resolve_model_path("builtin:tiny")
    counted = weights(path, json.loads(Path(path, "config.json").read_text()), {})
    assert counted.parameters == config_parameters(builtin_config("tiny"))
    assert counted.bytes == 2 * counted.parameters and counted.dtype == "bfloat16"  # stored fp32, loaded half
    assert round(config_parameters(LLAMA_70B) / 1e9, 2) == 70.55


def big_model(tmp_path) -> Path:
    """A model folder with Llama-3-70B's config.json and a tokenizer, no weights: counted from its config."""
    folder = tmp_path / "llama70"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_a_model_too_big_for_its_gpus_is_refused_before_ray_naming_the_smallest_tp_that_fits(tmp_path):
    spec = write_spec(tmp_path, [{"name": "big", "path": str(big_model(tmp_path)),
                                  "engine": {"tensor_parallel_size": 4}}],
                      actors={"count": 1, "num_cpus": 1, "accelerator_type": "L4"})
    with pytest.raises(PreflightError) as err:
        check_inputs(load_spec(spec))
    assert str(err.value) == (
        f"{spec}: model big: its weights take 131.4 GiB (70.55B parameters, bfloat16); with tensor_parallel_size 4 "
        "and pipeline_parallel_size 1 each GPU holds 32.9 GiB, and one L4 has 22.5 GiB, of which vLLM uses 0.9 less "
        "1 GiB for activations and the KV cache: 19.2 GiB. engine.tensor_parallel_size 8 is the smallest that fits")


def test_a_model_whose_weight_file_is_broken_is_refused_in_one_line_where_its_gpus_memory_is_checked(tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(resolve_model_path("builtin:tiny"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    spec = write_spec(tmp_path, [{"name": "b", "path": str(broken)}],
                      actors={"count": 1, "num_cpus": 1, "accelerator_type": "L4"})
    with pytest.raises(PreflightError) as err:
        check_inputs(load_spec(spec))
    assert str(err.value).startswith(f"{spec}: model b: its weights cannot be sized for the L4 memory check: "
                                     f"{broken / 'model.safetensors'}: not a safetensors file")


def test_the_same_model_at_the_tp_that_fits_passes_and_a_gpu_share_counts(tmp_path):
    found = weights(None, LLAMA_70B, {})
    assert refusal("big", {"tensor_parallel_size": 8}, found, ACCELERATOR_MEMORY["L4"], "an L4") is None
    assert refusal("big", {"tensor_parallel_size": 2}, found, ACCELERATOR_MEMORY["H200"], "an H200") is None
    # builtin:large (7B, 13.0 GiB in bf16) fits a whole L4, not half of one
    large = weights(None, builtin_config("large"), {})
    assert refusal("large", {}, large, ACCELERATOR_MEMORY["L4"], "an L4") is None
    half = refusal("large", {}, large, ACCELERATOR_MEMORY["L4"], "an L4", gpu_share=0.5, heads=32)
    assert "an L4 (0.5 of it) has 11.2 GiB" in half and half.endswith("tensor_parallel_size 2 is the smallest that fits")
    # two GPUs given to a one-GPU engine: it uses one (its room is not doubled)
    assert refusal("large", {}, large, ACCELERATOR_MEMORY["T4"], "a T4", gpu_share=2.0) is not None
    # weights vLLM keeps in CPU memory (cpu_offload_gb, per GPU) are not on the GPU
    assert refusal("large", {"cpu_offload_gb": 8}, large, ACCELERATOR_MEMORY["T4"], "a T4") is None


# Qwen3-30B-A3B's and Qwen1.5-MoE-A2.7B's shapes (their config.json): 30.5B and 14.3B parameters published
QWEN3_30B_A3B = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
QWEN15_MOE = {"hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60,
              "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
              "num_key_value_heads": 16, "vocab_size": 151936, "tie_word_embeddings": False}


def test_expert_models_are_counted_at_their_experts_width_and_unknown_shapes_not_at_all():
    """Qwen-MoE experts are moe_intermediate_size wide (counted at intermediate_size,
    Qwen3-30B-A3B would come out at 233B and be refused on an H100); DeepSeek's latent attention is not a shape
    the formula knows: no count, so no check, rather than a wrong one."""
    assert round(config_parameters(QWEN3_30B_A3B) / 1e9, 1) == 30.5
    assert round(config_parameters(QWEN15_MOE) / 1e9, 1) == 14.3
    assert refusal("moe", {}, weights(None, QWEN3_30B_A3B, {}), ACCELERATOR_MEMORY["H100"], "one H100") is None
    assert config_parameters(dict(QWEN3_30B_A3B, kv_lora_rank=512, n_routed_experts=64)) is None


def test_a_folder_with_two_copies_of_its_weights_is_counted_once(tmp_path, model_cache):
    """Mistral's folders hold consolidated.safetensors beside the same weights in shards; vLLM loads one set
    (the index's), and so does the count."""
    import shutil

    tiny = Path(resolve_model_path("builtin:tiny"))
    config = json.loads((tiny / "config.json").read_text())
    once = weights(str(tiny), config, {}).parameters
    shutil.copy(tiny / "model.safetensors", tmp_path / "model-00001-of-00001.safetensors")
    shutil.copy(tiny / "model.safetensors", tmp_path / "consolidated.safetensors")
    assert weights(str(tmp_path), config, {}).parameters == once  # no index: the copy beside shards is left out
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}))
    assert weights(str(tmp_path), config, {}).parameters == once


@pytest.mark.parametrize("content", [b"not a safetensors file", b"\x07", (10**12).to_bytes(8, "little") + b"{}",
                                     (2).to_bytes(8, "little") + b"[]"],
                         ids=["text", "shorter-than-a-length", "length-past-the-end", "no-tensor-table"])
def test_weight_files_that_are_not_safetensors_leave_the_size_unknown_without_reading_their_claimed_length(
        tmp_path, content):
    """A broken weight file (its engine will say why at its start) is no size, not a MemoryError at the checks:
    the header length it claims is checked against the file before anything is read."""
    from cluster.contracts.model_memory import weight_bytes

    config = json.loads((Path(resolve_model_path("builtin:tiny")) / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="not a safetensors"):
        weights(str(tmp_path), config, {})
    assert weight_bytes(str(tmp_path), config, {}) is None


@pytest.mark.parametrize("engine, message", [
    ({"tensor_parallel_size": 3}, "engine.tensor_parallel_size 3 does not divide the model's 64 attention heads "
                                  "(vLLM refuses it): use one of 1, 2, 4, 8, 16"),
    ({"tensor_parallel_size": 8, "distributed_executor_backend": "ray"},
     "engine.distributed_executor_backend 'ray': raysweep's actor holds the engine's 8 GPUs and runs vLLM's "
     "workers as its own processes (mp); drop the field"),
])
def test_parallel_settings_vllm_would_refuse_on_held_gpus_are_refused_before_ray(tmp_path, engine, message):
    spec = write_spec(tmp_path, [{"name": "big", "path": str(big_model(tmp_path)), "engine": engine}],
                      actors={"count": 1, "num_cpus": 1, "accelerator_type": "H200"})
    with pytest.raises(PreflightError) as err:
        check_inputs(load_spec(spec))
    assert str(err.value) == f"{spec}: model big: {message}"


@pytest.mark.slow
def test_a_tp4_actor_holds_four_gpus_of_one_node(engine_host, fake_cluster, tmp_path):
    """Two TP=4 actors on two nodes of 4 GPUs: each holds 4 distinct GPUs (one Ray actor always sits on one
    node, so its GPUs are that node's; what this checks is that raysweep asks for all 4 in one actor, and
    that two such actors run on the two nodes), and a TP=1 model beside them gets actors of one GPU. Every
    sample once. (2 + 2 GPUs across two nodes are refused: next test.)"""
    from cluster.schedule.run import run_sweep

    nodes = fake_cluster([{"num_cpus": 2, "num_gpus": 4}] * 2)
    spec = load_spec(write_spec(tmp_path, [
        {"name": "wide", "path": "builtin:tiny", "engine": {"backend": "fake", "tensor_parallel_size": 4}},
        {"name": "narrow", "path": "builtin:tiny", "engine": "fake"}], rows=40,
        actors={"count": 2, "num_cpus": 0.5}))
    report = run_sweep(spec, engine_host=engine_host, log=lambda line: None)
    assert not report.failed and report.samples == 80
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 80 and not results.duplicated(["model", "sample_id"]).any()
    actors = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    wide = actors[actors["model"] == "wide"].drop_duplicates("actor_id")
    assert (wide["gpus"] == 4).all() and wide["gpu_ids"].map(lambda ids: len(set(ids.split(",")))).eq(4).all()
    assert set(wide["node_id"]) <= {n.node_id for n in nodes}
    if len(wide) == 2:  # both TP=4 actors at once: one per node
        assert wide["node_id"].nunique() == 2
    assert (actors[actors["model"] == "narrow"]["gpus"] == 1).all()


@pytest.mark.slow
def test_four_gpus_on_two_nodes_never_hold_a_tp4_engine(fake_cluster, tmp_path):
    """The cluster has 4 GPUs, but 2 per node: a TP=4 actor cannot be placed, and the sweep says so in one
    line before any actor starts."""
    from cluster.plan.placement import PlacementError
    from cluster.schedule.run import run_sweep

    fake_cluster([{"num_cpus": 1, "num_gpus": 2}] * 2)
    spec = load_spec(write_spec(tmp_path, [{"name": "wide", "path": "builtin:tiny",
                                            "engine": {"backend": "fake", "tensor_parallel_size": 4}}]))
    with pytest.raises(PlacementError) as err:
        run_sweep(spec, log=lambda line: None)
    assert str(err.value) == ("models wide: an actor needs {CPU: 1, GPU: 4} (actors: in the spec), and no node of "
                              "the cluster has that; the largest has {CPU: 1, GPU: 2}")


@pytest.mark.slow
def test_shards_cut_at_the_tail_are_committed_once_each(engine_host, ray_local, tmp_path):
    """Two actors, one shard each at a time, three shards of 64: the last waiting ones are cut in halves
    (parts of at least MIN_PART_ROWS rows), run apart, and committed whole under their own ids; every
    sample once, and the run's record keeps the tail's idle share and how many shards were cut."""
    from cluster.schedule.run import run_sweep
    from cluster.store.manifest import read_manifest

    # each shard takes 2 s: the third waits while both actors run, however far apart their processes came up
    # (at once, the first actor up could run all three before the second was: 1 run in 4 cut nothing here)
    fake = {"backend": "fake", "delay_s": 2.0}
    spec = load_spec(write_spec(tmp_path, [{"name": "m", "path": "builtin:tiny", "engine": fake}], rows=192,
                                max_samples=64, actors={"count": 2, "num_cpus": 1, "shards_in_flight": 1}))
    report = run_sweep(spec, engine_host=engine_host, log=lambda line: None)
    assert not report.failed and report.samples == 192
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert sorted(results["sample_id"]) == sorted(f"s{i}" for i in range(192))
    manifest = read_manifest(str(tmp_path / "out"))
    assert sorted(manifest["shards"]) == [f"m/t/{i:05d}" for i in range(3)]
    assert all(e["state"] == "committed" and e["rows"] == 64 for e in manifest["shards"].values())
    shards = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pandas()
    parts = shards[shards["piece"].notna()]
    assert report.tail["tail_splits"] >= 1 and len(parts) >= 2
    assert parts["n_samples"].min() >= MIN_PART_ROWS
    run = manifest["runs"][-1]
    assert run["tail_splits"] == report.tail["tail_splits"] and 0 <= run["tail_idle_share"] < 1
    assert run["engines"] == {"count": 2, "num_gpus": 1.0, "engines_per_gpu": 1,  # the run records its actors
                              "reason": "no GPU in the cluster: one CPU engine per actor"}


def _tail_scheduler(ray_local, events, raising=("s90",), dies_once: str | None = None):
    """A scheduler of one model on two stand-in actors (one shard at a time each) and three 32-row shards:
    the third waits alone while both actors run, so it is cut in halves. Any batch holding a `raising` id
    raises; the first actor to run a 16-row part holding `dies_once` (a marker file's path, then the id)
    exits, once."""
    import pyarrow as pa

    from cluster.contracts.shard import Shard
    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork

    class _Actor:  # defined here so Ray ships the class by value
        def ready(self) -> dict:
            return {}

        def start_engine(self) -> dict:
            return {}

        def run_shard(self, shard, task, attempt):
            import time

            import pyarrow as pa

            import os

            time.sleep(0.5)
            ids = shard.rows["sample_id"].to_pylist()
            if dies_once and dies_once.split("|")[1] in ids and len(ids) == 16 \
                    and not os.path.exists(dies_once.split("|")[0]):
                time.sleep(0.7)  # the other part has raised meanwhile: the split is over
                open(dies_once.split("|")[0], "w").close()
                os._exit(1)
            for bad in raising:
                if bad in ids:
                    raise RuntimeError(f"engine broke on {bad}")
            return shard.rows.append_column("status", pa.array(["ok"] * len(ids))), {}

        def close(self) -> None:
            pass

    remote = ray_local.remote(_Actor).options(num_cpus=0.1, max_restarts=0)
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(), events, capacity=2)
    scheduler.add_model(ModelWork("m", max_actors=2, depth=1, start=lambda at: ()))
    shards = [Shard(f"m/t/{k:05d}", k, "m", "t", "short", None, True, 0,
                    pa.table({"sample_id": [f"s{i}" for i in range(32 * k, 32 * k + 32)]})) for k in range(3)]
    return scheduler, [Job(s, None) for s in shards]


@pytest.mark.slow
def test_a_tail_part_that_raises_sends_its_whole_shard_back(ray_local):
    """The part holding s90 raises: the split ends (its other part's result is dropped), the whole shard is
    retried whole, then bisected as any shard that raises alike twice, and reported once, with s90 the one
    row that fails alone. The shards that ran whole are reported once each."""
    from cluster.schedule.work import SchedulerEvents

    reported, attempts = [], []
    events = SchedulerEvents(
        on_result=lambda job, table, telemetry: reported.append(("result", job.shard.shard_id, job.piece is not None)),
        on_failed=lambda job: reported.append(("failed", job.shard.shard_id)),
        on_bisected=lambda job, table, errors: reported.append(("bisected", job.shard.shard_id, table.num_rows, errors)),
        on_split=lambda job, table: reported.append(("split", job.shard.shard_id)),
        on_attempt_failed=lambda job, error: attempts.append((job.shard.shard_id, job.piece is not None, job.attempt)))
    scheduler, jobs = _tail_scheduler(ray_local, events)
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    wholes = [r for r in reported if r[0] == "result" and not r[2]]
    assert sorted(r[1] for r in wholes) == ["m/t/00000", "m/t/00001"]
    assert scheduler.tail_splits == 1 and not [r for r in reported if r[0] in ("split", "failed")]
    bisected = [r for r in reported if r[0] == "bisected"]
    assert bisected == [("bisected", "m/t/00002", 32, {"s90": "RuntimeError: engine broke on s90"})]
    # the part that raised, then the whole shard's first attempt (the split's), its second (run whole)
    assert attempts[:3] == [("m/t/00002", True, 1), ("m/t/00002", False, 1), ("m/t/00002", False, 2)]
    # the retry and bisection's parts ran on the two actors that were there: none was released while the
    # model's shard ran elsewhere, so none had to start again (on vLLM: minutes each)
    assert scheduler.fleet.actors_started == 2


def _recorder():
    from cluster.schedule.work import SchedulerEvents

    reported = []
    events = SchedulerEvents(
        on_result=lambda job, table, telemetry: reported.append(
            ("result", job.shard.shard_id, job.piece.rows if job.piece else None,
             type(job.piece.bisection).__name__ if job.piece else None)),
        on_failed=lambda job: reported.append(("failed", job.shard.shard_id)),
        on_bisected=lambda job, table, errors: reported.append(("bisected", job.shard.shard_id, table.num_rows,
                                                               tuple(sorted(errors)))),
        on_split=lambda job, table: reported.append(("split", job.shard.shard_id)),
        on_attempt_failed=lambda job, error: reported.append(
            ("attempt", job.shard.shard_id, job.piece.rows if job.piece else None)))
    return reported, events


@pytest.mark.slow
def test_both_parts_of_a_tail_split_raising_send_the_shard_back_once(ray_local):
    """Both halves raise (an error in each, run at once on the two actors): the whole shard is retried once,
    bisected once and reported once (not retried, bisected and committed twice)."""
    reported, events = _recorder()
    scheduler, jobs = _tail_scheduler(ray_local, events, raising=("s70", "s90"))
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    ends = [r for r in reported if r[0] in ("bisected", "failed", "split") or r[:3] == ("result", "m/t/00002", None)]
    assert ends == [("bisected", "m/t/00002", 32, ("s70", "s90"))]
    # whole attempts: the split's, then whole runs until two fail alike (the first half to raise names s70
    # or s90, a whole run names s70): 2 or 3, never one per part that raised
    assert [r for r in reported if r[0] == "attempt" and r[2] is None] in ([("attempt", "m/t/00002", None)] * 2,
                                                                          [("attempt", "m/t/00002", None)] * 3)


@pytest.mark.slow
def test_a_part_of_an_ended_split_whose_actor_died_is_not_run_again(ray_local, tmp_path):
    """Part 0:16 raises, ending the split; part 16:32's actor then dies: that part is dropped, not queued
    again on a new actor (its shard is already running whole), and the shard is reported once."""
    reported, events = _recorder()
    scheduler, jobs = _tail_scheduler(ray_local, events, raising=("s70",), dies_once=f"{tmp_path / 'died'}|s90")
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    assert (tmp_path / "died").exists()
    assert not [r for r in reported if r[0] == "result" and r[3] == "TailSplit"], reported
    ends = [r for r in reported if r[0] in ("bisected", "failed", "split") or r[:3] == ("result", "m/t/00002", None)]
    assert ends == [("bisected", "m/t/00002", 32, ("s70",))]


def test_tail_idle_counts_gpu_seconds_after_each_actors_last_shard_and_none_after_a_death(monkeypatch):
    """Three 1-GPU actors from t=0, their last shards back at 40, 90 and 100 (the run's end): 60 + 10 of 300
    GPU-seconds idle. Once the first is known to have died at 50, it adds 10 idle of 50 held, not 60 of 100."""
    import cluster.schedule.tail_split as tail_split

    now = [0.0]
    monkeypatch.setattr(tail_split.time, "time", lambda: now[0])
    clock = tail_split.TailClock()
    clock.sent(0, 1.0), clock.sent(1, 1.0), clock.sent(2, 1.0)
    for at, number in ((40.0, 2), (90.0, 0), (100.0, 1)):
        now[0] = at
        clock.back(number)
    assert clock.record() == {"tail_idle_gpu_s": 70.0, "tail_idle_share": 0.2333}  # 10 + 60 of 300: death unseen
    clock.actors[2][3] = 50.0  # as clock.died(2) at t=50
    assert clock.record() == {"tail_idle_gpu_s": 20.0, "tail_idle_share": 0.08}  # 10 + 10 of 250


def test_a_shard_of_long_prompts_is_cut_down_to_rows_a_short_one_to_16(tmp_path):
    """A long-profile shard of 8 prompts (each a chunked prefill) can be cut; a short one needs 32 rows."""
    from types import SimpleNamespace

    from cluster.schedule.tail_split import splittable

    def job(rows: int, profile: str, attempt: int = 1, piece=None):
        return SimpleNamespace(piece=piece, attempt=attempt, shard=SimpleNamespace(n_samples=rows, profile=profile))

    assert splittable(job(8, "long")) and splittable(job(2, "long")) and not splittable(job(1, "long"))
    assert not splittable(job(31, "short")) and splittable(job(2 * MIN_PART_ROWS, "short"))
    assert not splittable(job(8, "long", attempt=2)) and not splittable(job(8, "long", piece=object()))


@pytest.mark.slow
def test_the_first_engine_up_does_not_take_the_shards_of_one_still_starting(ray_local):
    """Tails cut across engines still starting: two actors of a model, two shards in flight each; the second's engine comes up 1 s
    after the first's. Three shards of 128, 128 and 72 rows (1,312 prompts in 512, 512 and 288 on an H100
    had two engines idle 33% at the tail): the first engine up must not take 256 rows while the second
    starts. Each shard of 128 rows is cut in halves (a fair part: 328 rows over 4 held shards is 82), and the
    two actors end close together. Rows take 30 ms each, a shard's rows one after the other."""
    import pyarrow as pa

    from cluster.contracts.shard import Shard
    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    class _Actor:  # defined here so Ray ships the class by value
        def __init__(self, number: int):
            self.number = number

        def ready(self) -> dict:
            return {}

        def start_engine(self) -> dict:
            import time

            time.sleep(1.0 * self.number)
            return {}

        def run_shard(self, shard, task, attempt):
            import time

            import pyarrow as pa

            ids = shard.rows["sample_id"].to_pylist()
            time.sleep(0.03 * len(ids))
            return shard.rows.append_column("status", pa.array(["ok"] * len(ids))), {"actor": self.number}

        def close(self) -> None:
            pass

    ran: dict[int, int] = {}
    events = SchedulerEvents(on_result=lambda job, table, telemetry: ran.__setitem__(
        telemetry["actor"], ran.get(telemetry["actor"], 0) + table.num_rows), on_failed=lambda job: None,
        on_split=lambda job, table: None)
    remote = ray_local.remote(_Actor).options(num_cpus=0.1, max_restarts=0)
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(n), events, capacity=2)
    scheduler.add_model(ModelWork("m", max_actors=2, depth=2, start=lambda at: ()))
    sizes, start = (128, 128, 72), 0
    shards = []
    for k, size in enumerate(sizes):
        shards.append(Shard(f"m/t/{k:05d}", k, "m", "t", "short", None, True, 0,
                            pa.table({"sample_id": [f"s{i}" for i in range(start, start + size)]})))
        start += size
    scheduler.run(lambda timeout_s: scheduler.add_jobs([Job(s, None) for s in shards]) or True)
    assert sum(ran.values()) == 328 and scheduler.tail_splits >= 2, ran
    # the old rule: 256 rows on the first engine (its two shards taken while the second started), 72 on the
    # second, which then idled; the first actor, up earlier, may still run more rows than the second
    assert ran.get(1, 0) > 72, ran
    assert scheduler.tail.record()["tail_idle_share"] < 0.2, (ran, scheduler.tail.record())


@pytest.mark.slow
def test_an_actor_whose_model_is_done_runs_the_tail_of_another_model(ray_local, tmp_path):
    """Tails across models: two models of one actor each (a CPU sweep's default). Model a has one
    shard, model b six, each shard 0.3 s: once a is done its actor takes b's waiting shards (a model change)
    rather than idling while b's one actor runs the rest (before: 27.7% of actor-seconds idle at the tail of
    a tiny + small sweep on two CPU actors). b's own actor holds its first shard until the other actor has run
    one of b's: on a loaded machine an actor that came up seconds late found b's shards all done."""
    import pyarrow as pa

    from cluster.contracts.shard import Shard
    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    helped = str(tmp_path / "helped")  # written when the actor that began on model a runs a shard of b

    class _Actor:  # defined here so Ray ships the class by value
        def __init__(self, number: int):
            self.number, self.models = number, []

        def ready(self) -> dict:
            return {}

        def start_engine(self, model: str) -> dict:
            self.models.append(model)
            return {}

        def run_shard(self, shard, task, attempt):
            import os
            import time

            import pyarrow as pa

            if shard.model == "b" and self.models[0] == "a":
                open(helped, "w").close()
            deadline = time.monotonic() + 30  # a scheduler that never hands b's shards over fails below, not hangs
            while self.models[0] == "b" and not os.path.exists(helped):
                if time.monotonic() > deadline:
                    open(helped, "w").close()  # once: the other shards do not wait again
                time.sleep(0.05)
            time.sleep(0.3)
            return shard.rows.append_column("status", pa.array(["ok"] * shard.rows.num_rows)), {"actor": self.number}

        def close(self) -> None:
            pass

    ran: dict[tuple, int] = {}
    events = SchedulerEvents(on_result=lambda job, table, telemetry: ran.__setitem__(
        (job.shard.model, telemetry["actor"]), ran.get((job.shard.model, telemetry["actor"]), 0) + 1),
        on_failed=lambda job: None)
    remote = ray_local.remote(_Actor).options(num_cpus=0.1, max_restarts=0)
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(n), events, capacity=2)
    for name in "ab":
        scheduler.add_model(ModelWork(name, max_actors=1, depth=1,
                                      start=lambda at, name=name: (name,)))
    jobs = [Job(Shard(f"{m}/t/{k:05d}", k, m, "t", "short", None, True, 0, pa.table({"sample_id": [f"{m}{k}"]})), None)
            for m, n in (("a", 1), ("b", 6)) for k in range(n)]
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    assert sum(ran.values()) == 7 and scheduler.fleet.model_changes == 1, ran
    b_actors = {actor for (model, actor) in ran if model == "b"}
    assert len(b_actors) == 2, ran  # both actors ran b's shards


@pytest.mark.slow
def test_a_fast_models_cpu_actor_takes_shards_of_a_slow_one_in_a_real_sweep(engine_host, ray_local, tmp_path,
                                                                            monkeypatch):
    """A fast and a slow model, one CPU actor each, 48 rows in shards of 6, `max_num_seqs: 8`: each CPU actor
    holds two shards (its engine runs one batch at a time), so the slow model's shards wait in the driver,
    and the fast model's actor, once done, runs some of them. Before, each actor held six (the depth that
    fills a streaming engine's batches), the slow actor took six of its eight shards at once, nothing waited,
    and the fast actor idled for the rest of the sweep (47% of the actors' time at the tail)."""
    from cluster.inputs import builtin_model
    from cluster.schedule.run import run_sweep
    from cluster.store.manifest import read_manifest

    monkeypatch.setitem(builtin_model.CONFIGS, "slowish", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=4096, seed=7))
    builtin_model.build("slowish", tmp_path / "slowish")  # a local folder: the actors load it as any model
    rows = [json.loads(line) for line in open(Path(__file__).parents[1] / "sweeps" / "data" / "arithmetic.jsonl")]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:48]))
    spec = {"name": "tails", "output": str(tmp_path / "out"),
            "models": [{"name": "fast", "path": "builtin:tiny", "engine": {"max_num_seqs": 8}},
                       {"name": "slow", "path": str(tmp_path / "slowish"), "engine": {"max_num_seqs": 8}}],
            "tasks": [{"name": "t", "data": str(tmp_path / "a.jsonl"), "id_column": "id",
                       "prompt": "Question: {question}\nAnswer:", "sampling": {"max_tokens": 24}}],
            "shards": {"max_samples": 6}, "actors": {"count": 1, "num_cpus": 1}}
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    report = run_sweep(load_spec(tmp_path / "s.yaml"), engine_host=engine_host, log=print)
    assert not report.failed
    shards = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pandas()
    fast_actor = set(shards[shards.model == "fast"].actor_id)
    assert len(shards[shards.model == "slow"]) == 8 and len(fast_actor) == 1
    helped = shards[(shards.model == "slow") & shards.actor_id.isin(fast_actor)]
    print(f"slow shards run by the fast model's actor: {len(helped)} of 8; tail idle share "
          f"{read_manifest(str(tmp_path / 'out'))['runs'][-1].get('tail_idle_share')}")
    assert len(helped) >= 1
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 96 and not results.duplicated(["model", "sample_id"]).any()


@pytest.mark.parametrize("replicas, cut", [(1, 0), (2, 2)])
def test_a_pools_shards_are_cut_for_its_replicas_but_not_for_one(replicas, cut):
    """Tails on the pool: three shards of 128, 128 and 72 rows for a pool holding 4 shards at once
    are cut where the pool runs the model on two replicas (the two 128s in halves: a fair part is 328 / 4),
    and left whole on one replica, which runs every shard anyway."""
    import pyarrow as pa

    from cluster.contracts.shard import Shard
    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    events = SchedulerEvents(on_result=lambda *a: None, on_failed=lambda job: None, on_split=lambda job, t: None)
    scheduler = SweepScheduler(lambda n, at, shape: None, events)
    model = ModelWork("m", max_actors=1, depth=2, start=lambda at: ())
    scheduler.add_model(model)
    scheduler.fleet.lend("m", object(), depth=4, replicas=replicas)
    start = 0
    for k, size in enumerate((128, 128, 72)):
        rows = pa.table({"sample_id": [f"s{i}" for i in range(start, start + size)]})
        scheduler.add_jobs([Job(Shard(f"m/t/{k:05d}", k, "m", "t", "short", None, True, 0, rows), None)])
        start += size
    scheduler._split_tail(model)
    assert scheduler.tail_splits == cut
    assert sorted(j.shard.n_samples for q in model.queues.values() for j in q) == (
        [64, 64, 64, 64, 72] if cut else [72, 128, 128])
