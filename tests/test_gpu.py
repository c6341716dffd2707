"""GPU tests (run on the lent H100; skipped without CUDA and vLLM): builtin:tiny under vLLM with CUDA
graphs captured, structured outputs always valid, and a sweep whose two actors share one GPU and whose
long shard runs with chunked prefill while its short shards run without."""

import json
from pathlib import Path

import pytest

from actors.engine_factory import cuda_and_vllm_available

from tests.conftest import ROOT, gpu_count


# the quickstart's four-way choice task, structured, as an entry of a spec's `tasks:` (YAML)
CHOICE_TASK = f"""  - name: choice
    data: {ROOT / 'sweeps' / 'data' / 'choice.jsonl'}
    id_column: id
    prompt: "{{question}} A. {{A}} B. {{B}} C. {{C}} D. {{D}} Answer:"
    target: answer
    structured: {{choice: [A, B, C, D]}}
    scorer: choice
"""

def mixed_spec(path: Path, name: str, rows: int, seed: int, output: Path | None = None) -> Path:
    """A spec at `path` of builtin:tiny on vLLM over two half-GPU actors: `rows` prompts of 20-200 characters,
    every sixth of 12-14k (a long shard, chunked prefill), beside the structured choice task; shards of 8."""
    import random

    rng = random.Random(seed)
    with open(path.parent / "mixed.jsonl", "w") as f:
        for i in range(rows):
            n = rng.randint(12_000, 14_000) if i % 6 == 0 else rng.randint(20, 200)
            f.write(json.dumps({"id": f"s{i}", "text": "".join(rng.choice("abcdefgh ") for _ in range(n))}) + "\n")
    path.write_text(f"""
name: {name}
{f"output: {output}" if output else ""}
models:
  - {{name: tiny, path: 'builtin:tiny', engine: {{backend: vllm, max_model_len: 16384}}}}
tasks:
  - {{name: mixed, data: mixed.jsonl, id_column: id, prompt: "{{text}}\\nSummary:",
      sampling: {{max_tokens: 32, temperature: 1.0, stop: ["."]}}}}
{CHOICE_TASK}shards: {{max_samples: 8}}
actors: {{count: 2, num_gpus: 0.5, num_cpus: 1}}
""")
    return path


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_and_vllm_available(), reason="needs CUDA and vLLM")]


@pytest.mark.slow
def test_sweep_two_actors_one_gpu_long_and_short_shards(ray_local, tiny_path, tmp_path):
    """48 samples, 8 of them 12-14k-token prompts: short shards without chunked prefill, the long one
    with it; two actors of 0.5 GPU each; every sample exactly once."""
    import pyarrow.parquet as pq

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    mixed_spec(tmp_path / "gpu.yaml", "gpu-mixed", rows=48, seed=0, output=tmp_path / "out")
    from tests.test_metrics import MetricsWatcher

    with MetricsWatcher("gpu-mixed") as watcher:
        report = run_sweep(load_spec(tmp_path / "gpu.yaml"), log=print)
        watcher.wait_for_total("ray_raysweep_samples_done_total", 148)
    assert not report.failed
    gpu_metric = watcher.series("ray_raysweep_gpu_memory_used_mib")
    print("Prometheus raysweep_gpu_memory_used_mib:", gpu_metric)
    shards = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pandas()
    # one series per actor that ran shards: the scheduler sends shards to the first engine that is up,
    # so on a cold compile cache the second may still be starting when the first has done them all
    assert len(gpu_metric) == shards["actor_id"].nunique() and min(gpu_metric.values()) > 0
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 148 and results[["task", "sample_id"]].astype(str).drop_duplicates().shape[0] == 148
    assert results[results["task"] == "choice"]["structured_valid"].all()
    assert results["ttft_s"].notna().all()
    print(shards[["shard_id", "profile", "chunked_prefill", "max_num_batched_tokens", "cuda_graphs", "graph_mode",
                  "prompt_tokens", "output_tok_per_s", "engine_batch_mean", "gpu_mem_used_max_mib",
                  "gpu_util_mean_pct"]].to_string())
    assert (shards["engine_batch_mean"] >= 1).all()  # the engine thread counted its steps for every shard
    long = shards[shards["profile"] == "long"]
    short = shards[shards["profile"] == "short"]
    assert len(long) >= 1 and long["chunked_prefill"].all() and (long["max_num_batched_tokens"] < 12_000).all()
    assert len(short) >= 1 and not short["chunked_prefill"].any()
    starts = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    print(starts[["actor_id", "reason", "profile", "engine_core", "engine_init_s", "graph_mode",
                  "fallback_reason"]].to_string())
    assert starts["fallback_reason"].isna().all(), starts["fallback_reason"].dropna().tolist()
    assert shards["cuda_graphs"].all() and shards["gpu_mem_used_max_mib"].notna().all()
    gpu = pq.read_table(tmp_path / "out" / "telemetry" / "gpu.parquet").to_pandas()
    print(f"gpu.parquet: {len(gpu)} samples, mem_used_mib {gpu['mem_used_mib'].min():.0f}-"
          f"{gpu['mem_used_mib'].max():.0f}, util max {gpu['util_pct'].max():.0f}%, power max {gpu['power_w'].max():.0f} W")
    weights_mib = sum(p.stat().st_size for p in Path(tiny_path).glob("*.safetensors")) / 2**20
    assert len(gpu) > 0 and (gpu["mem_used_mib"] > weights_mib).all() and gpu["gpu_name"].notna().all()
    assert shards["gpu_util_mean_pct"].notna().all() and shards["power_mean_w"].notna().all()
    actors = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    print(actors.to_string())
    assert (actors["graph_mode"] != "NONE").all() and actors["fallback_reason"].isna().all()
    assert set(actors["profile"]) == {"short", "long"}


def _engine_host_processes(run: str) -> set[int]:
    """Live processes of the command whose environment holds RAYSWEEP_TEST_RUN=`run` (the environment goes down
    to every process it starts) running actors/engine_host.py (engine hosts and the engine processes forked from
    them) or named by vLLM (`VLLM::EngineCore`: vLLM renames its engine core's process). Other GPU tests running
    beside this one on the same machine have engine cores of their own: they are not this command's."""
    import os

    mark = f"RAYSWEEP_TEST_RUN={run}".encode()
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                ours = mark in f.read().split(b"\0")
        except OSError:
            continue
        if ours and (b"-m actors.engine_host" in command or command.startswith(b"VLLM::")) and state != "Z":
            found.add(int(pid))
    return found


def _local_command(spec: Path, out: Path, env: dict | None = None) -> str:
    """`jobs.sweep SPEC --output OUT` as a user runs it, with a new local Ray, to exit 0 (`env`: more of its
    environment); returns the mark its processes carry (`_engine_host_processes`)."""
    import os
    import subprocess
    import sys
    import uuid

    run = uuid.uuid4().hex
    done = subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out)],
                          cwd=ROOT, env=os.environ | {"RAY_ADDRESS": "local", "RAYSWEEP_TEST_RUN": run} | (env or {}),
                          capture_output=True, text=True, timeout=500)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return run


def _nothing_left(run: str) -> None:
    """No engine host, engine process or engine core of the command `run` outlived it (an engine process goes
    once it sees its actor's connection end)."""
    import time

    deadline = time.monotonic() + 20
    while _engine_host_processes(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _engine_host_processes(run) == set(), "an engine host, engine process or engine core outlived the command"


@pytest.mark.slow
def test_a_local_command_line_sweep_runs_its_engines_forked_from_the_engine_host(tmp_path, tiny_path):
    """`raysweep run` with a new local Ray: two half-GPU actors run their vLLM engines in processes forked from
    the run's engine host (imported before Ray started), with vLLM's engine core forked from there as outside
    Ray: their first engines are the ones the host built before Ray was up ("early"), and a long shard's profile
    restart asks the host for a new one ("host"); CUDA graphs captured; structured outputs valid; nothing of the
    host or its engines is left once the command exits. The built-in model is built first (`tiny_path`), as a
    user's later runs find it: one not built yet is built by the planner, once Ray is up, and gets no early engine.
    The command sees one GPU: on two, the spec's two actors are not the four that fill them, and none is built early
    (cluster/plan/early_engines.py)."""
    import os

    import pyarrow.parquet as pq

    mixed_spec(tmp_path / "host.yaml", "gpu-host", rows=24, seed=1)
    out = tmp_path / "out"
    one_gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    run = _local_command(tmp_path / "host.yaml", out, env={"CUDA_VISIBLE_DEVICES": one_gpu})
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    print(actors[["actor_id", "reason", "profile", "engine_process", "engine_core", "imports_s", "engine_init_s",
                  "graph_mode", "fallback_reason"]].to_string())
    first, restarts = actors[actors["reason"] == "first"], actors[actors["reason"] == "profile"]
    assert set(first["engine_process"]) == {"early"} and set(restarts["engine_process"]) == {"host"}
    assert set(actors["engine_core"]) == {"forked"}
    assert actors["fallback_reason"].isna().all() and (actors["graph_mode"] != "NONE").all()
    assert set(actors["profile"]) == {"short", "long"}
    results = pq.read_table(out / "results").to_pandas()
    assert len(results) == 124 and results[["task", "sample_id"]].astype(str).drop_duplicates().shape[0] == 124
    assert (results["status"] != "error").all() and results[results["task"] == "choice"]["structured_valid"].all()
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    assert shards["cuda_graphs"].all() and (shards["engine_batch_mean"] >= 1).all()
    _nothing_left(run)


@pytest.mark.slow
@pytest.mark.parametrize("num_gpus", [1, 0.5])
def test_a_local_sweep_of_whole_or_half_gpus_runs_on_engines_built_before_ray_was_up(tmp_path, tiny_path, num_gpus):
    """`raysweep run` with a new local Ray, one model and `actors: {num_gpus: N}` (1/N actors per visible GPU): the
    driver asks the engine host for each actor's engine before Ray is up (cluster/plan/early_engines.py), and each
    actor's first engine is one of those of its GPU, forked as outside Ray with CUDA graphs; every row once,
    structured outputs valid, and nothing of the host or its engines left once the command exits. The task is one
    shard: an actor whose engine is not up when the first has done it starts none (the actors table has a row per
    engine start), and its engine, still building, is ended with the rest."""
    import pyarrow.parquet as pq

    (tmp_path / "early.yaml").write_text(f"""
name: gpu-early
models:
  - {{name: tiny, path: 'builtin:tiny', engine: {{backend: vllm}}}}
tasks:
{CHOICE_TASK}actors: {{num_gpus: {num_gpus}}}
""")
    out = tmp_path / "out"
    run = _local_command(tmp_path / "early.yaml", out)
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    print(actors[["actor_id", "gpu_ids", "reason", "engine_process", "engine_core", "imports_s", "engine_init_s",
                  "startup_s", "graph_mode", "fallback_reason"]].to_string())
    assert 1 <= len(actors) <= gpu_count() * round(1 / num_gpus) and actors["actor_id"].is_unique
    assert set(actors["engine_process"]) == {"early"} and set(actors["reason"]) == {"first"}
    assert set(actors["engine_core"]) == {"forked"} and (actors["graph_mode"] != "NONE").all()
    results = pq.read_table(out / "results").to_pandas()
    rows = [line for line in (ROOT / "sweeps" / "data" / "choice.jsonl").read_text().splitlines() if line.strip()]
    assert results["sample_id"].is_unique and len(results) == len(rows)
    assert (results["status"] == "ok").all() and results["structured_valid"].all()
    _nothing_left(run)


@pytest.fixture(scope="module")
def vllm_engine(tiny_path):
    from actors.engine import EngineProfile
    from actors.vllm_engine import VllmEngine
    from cluster.contracts.spec import ModelSpec

    engine = VllmEngine(ModelSpec("tiny", "builtin:tiny", engine={"gpu_memory_utilization": 0.3}),
                        tiny_path, EngineProfile(), exit_on_error=False)  # a failure fails its tests, not pytest
    yield engine
    engine.close()


@pytest.mark.slow
def test_cuda_graphs_captured(vllm_engine):
    info = vllm_engine.startup()
    print("engine start:", json.dumps(info))
    assert info["cuda_graphs"] and info["graph_mode"] in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
    assert info["fallback_reason"] is None and info["graph_capture_s"] is not None
    # vLLM's start-up report read step by step: the weights, then the engine core's init, which holds the rest
    assert 0 < info["weights_s"] < info["engine_init_s"] and 0 < info["core_init_s"] < info["engine_init_s"]
    assert info["chunked_prefill"] is False  # short profile: off, vLLM took it


REGISTRY_PROBE = """
import json, sys
from vllm.model_executor.models import registry
from actors.vllm_registry import inspect_here
started = []
def in_subprocess(fn):  # vLLM's own step, recorded: it must not be taken
    started.append(fn)
    return fn()
registry._run_in_subprocess = in_subprocess
first = inspect_here(sys.argv[1])
put_back = registry._run_in_subprocess is in_subprocess
registry._try_inspect_model_cls.cache_clear()  # as a later process would: vLLM's cache file answers
again = registry.ModelRegistry._try_inspect_model_cls("LlamaForCausalLM") is not None
print(json.dumps({"first": first, "started": len(started), "put_back": put_back, "again": again,
                  "none": inspect_here(sys.argv[2])}))
"""


@pytest.mark.slow
def test_vllms_registry_inspects_the_models_class_in_this_process_and_writes_its_cache(tiny_path, tmp_path):
    """On a node new to vLLM (a fresh interpreter, its cache empty), the model's class is inspected in the engine's
    process, not in the new interpreter vLLM's registry would start (actors/vllm_registry.py), and vLLM's cache
    entry is written for the next start."""
    import os
    import subprocess
    import sys

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # vLLM's, where set
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-c", REGISTRY_PROBE, tiny_path, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == {"first": ["LlamaForCausalLM"], "started": 0, "put_back": True, "again": True, "none": []}
    assert [p.name for p in (tmp_path / "vllm" / "modelinfos").iterdir()] == [
        "vllm-model_executor-models-llama-LlamaForCausalLM.json"]


@pytest.mark.slow
def test_greedy_generation_and_request_metrics(vllm_engine):
    from actors.engine import GenRequest
    from cluster.contracts.spec import SamplingSpec

    reqs = [GenRequest(str(i), list(f"Question {i}: what?".encode()), i) for i in range(8)]
    a = vllm_engine.generate(reqs, SamplingSpec(max_tokens=16), None)
    b = vllm_engine.generate(reqs, SamplingSpec(max_tokens=16), None)
    assert [r.output_text for r in a] == [r.output_text for r in b]
    assert all(r.output_tokens == 16 and r.finish_reason == "length" for r in a)
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s for r in a)


@pytest.mark.parametrize("kind, value", [
    ("json_schema", {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                     "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}}}),
    ("choice", ["yes", "no", "maybe"]),
    ("regex", r"[0-9]{3}-[A-Z]{2}"),
    ("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
])
@pytest.mark.slow
def test_structured_outputs_all_valid(vllm_engine, kind, value):
    from actors.engine import GenRequest
    from cluster.contracts.spec import SamplingSpec, StructuredSpec
    from cluster.contracts.structured import is_valid

    spec = StructuredSpec(kind, value)
    reqs = [GenRequest(str(i), list(b"Answer:"), 100 + i) for i in range(64)]
    out = vllm_engine.generate(reqs, SamplingSpec(max_tokens=64, temperature=1.0), spec)
    texts = [r.output_text for r in out]
    valid = sum(is_valid(spec, t) for t in texts)
    print(f"{kind}: {valid}/64 valid, e.g. {texts[:3]}")
    assert valid == 64, [t for t in texts if not is_valid(spec, t)]
    assert len(set(texts)) > 1


@pytest.mark.slow
@pytest.mark.skipif(gpu_count() > 1, reason="one actor changing model needs a Ray of one GPU: run this file with "
                                            "CUDA_VISIBLE_DEVICES=0 (with more, each model gets a GPU of its own)")
def test_two_models_one_gpu_change_model_in_the_same_actor(ray_local, tmp_path):
    """Two models on one whole GPU: one actor runs the first, then changes model (a new engine in the
    same actor: its engine core shut down and a new one started); start-up figures for each start.
    (0.4 of the GPU each: this module's engine fixture holds 0.3 of it while this runs.)"""
    import pyarrow.parquet as pq

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    (tmp_path / "two.yaml").write_text(f"""
name: gpu-two-models
output: {tmp_path / 'out'}
models:
  - {{name: a, path: 'builtin:tiny', engine: {{backend: vllm, max_num_seqs: 32, gpu_memory_utilization: 0.4}}}}
  - {{name: b, path: 'builtin:tiny', engine: {{backend: vllm, max_num_seqs: 64, gpu_memory_utilization: 0.4}}}}
tasks:
{CHOICE_TASK}shards: {{max_samples: 25}}
actors: {{count: 1, num_gpus: 1, num_cpus: 1}}
""")
    report = run_sweep(load_spec(tmp_path / "two.yaml"), log=print)
    assert not report.failed and report.samples == 200 and report.model_changes == 1
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 200 and results["structured_valid"].all()
    starts = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    columns = ["model", "reason", "engine_core", "process_s", "imports_s", "waiting_s", "engine_init_s",
               "weights_s", "core_init_s", "warmup_s", "startup_s", "first_token_s", "compile_s", "profile_run_s",
               "graph_capture_s", "graph_mode"]
    print(starts[columns].to_string())
    assert list(starts["reason"]) == ["first", "model"] and starts["actor_id"].nunique() == 1
    assert starts[["engine_init_s", "warmup_s", "startup_s", "first_token_s"]].notna().all().all()
    assert (starts["graph_mode"] != "NONE").all() and starts["fallback_reason"].isna().all()


@pytest.mark.slow
def test_sleep_mode_switch_keeps_each_models_outputs_and_gives_the_memory_back(tiny_path):
    """Two engines in one actor with vLLM's sleep mode (a switching pool replica): the second starts while
    the first sleeps, so together they hold about one engine's memory; a switch wakes the first with
    the same greedy outputs as before it slept, far faster than its start."""
    import time

    import pynvml

    from actors.engine import GenRequest
    from actors.evaluator import EvalActor
    from actors.telemetry import _nvml_handle
    from cluster.contracts.spec import ModelSpec, SamplingSpec

    def used() -> int:
        return pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle()).used

    def outputs(actor) -> list[str]:
        reqs = [GenRequest(str(i), list(f"Question {i}: what?".encode()), i) for i in range(8)]
        return [r.output_text for r in actor.engine.engine.generate(reqs, SamplingSpec(max_tokens=16), None)]

    total, before = pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle()).total, used()
    actor = EvalActor(time.time(), 1, 1, backends=("vllm",), sleep_mode=True)
    try:
        expected, starts = {}, []
        for name, seqs in (("a", 32), ("b", 64)):  # a sleeps as b starts
            model = ModelSpec(name, "builtin:tiny", backend="vllm",
                              engine={"max_num_seqs": seqs, "gpu_memory_utilization": 0.3})
            starts.append(actor.start_engine(model, tiny_path, time.time()))
            expected[name] = outputs(actor)
        held = used() - before
        print(f"memory held by both engines: {held / 2**30:.1f} GiB of {total / 2**30:.0f}")
        assert held < 0.45 * total  # two awake engines would hold 0.6 of the GPU
        switches = []
        for name in ("a", "b", "a", "b"):
            switches.append(actor.switch(name))
            assert outputs(actor) == expected[name], name
        print("switches:", json.dumps([{k: r[k] for k in ("slept_model", "model", "sleep_s", "wake_s")} for r in switches]))
        print("starts:", [round(s["startup_s"], 2) for s in starts])
        assert max(r["switch_s"] for r in switches) < 0.5 * min(s["startup_s"] for s in starts)
    finally:
        actor.close()


@pytest.mark.slow
def test_raysweep_hands_vllm_what_a_plain_generate_over_the_strings_would(vllm_engine):
    """The same prompts through a plain `LLM.generate(strings, SamplingParams(max_tokens, temperature))` and
    through raysweep's path (the planner's token ids, sampling_kwargs, the engine thread's `enqueue`): the
    requests vLLM builds (its input processor's EngineCoreRequests) carry the same token ids and sampling
    settings, and the outputs are the same."""
    from vllm import SamplingParams

    from actors.engine import GenRequest
    from cluster.contracts.tokens import tokenize
    from cluster.contracts.spec import SamplingSpec

    prompts = ["Question: 2+2?\nAnswer:", "  leading and trailing spaces  ", "naïve café — ünïcödé ✓ 日本語",
               "tabs\tand\nnewlines\n\n", "x" * 300, "<|user|>special-looking text<|end|>"]
    processor = vllm_engine.llm.llm_engine.input_processor
    seen, process = [], processor.process_inputs

    def spy(*args, **kwargs):
        request = process(*args, **kwargs)
        seen.append(request)
        return request

    processor.process_inputs = spy
    try:  # the engine thread waits on its inbox meanwhile: this thread may drive the LLM
        plain = vllm_engine.llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        ids = tokenize(prompts, vllm_engine.tokenizer, add_special_tokens=True)
        ours = vllm_engine.generate([GenRequest(str(i), x, 1000 + i) for i, x in enumerate(ids)],
                                    SamplingSpec(max_tokens=16), None)
    finally:
        processor.process_inputs = process
    fields = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
              "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
              "include_stop_str_in_output", "detokenize", "structured_outputs", "logit_bias", "allowed_token_ids",
              "bad_words")

    def settings(request) -> dict:
        return {f: getattr(request.sampling_params, f, "(absent)") for f in fields}

    assert len(seen) == 2 * len(prompts)
    for plain_request, our_request in zip(seen[:len(prompts)], seen[len(prompts):]):
        assert list(our_request.prompt_token_ids) == list(plain_request.prompt_token_ids)
        assert settings(our_request) == settings(plain_request)
    print("sampling settings both ways:", settings(seen[0]))
    assert [o.outputs[0].text for o in plain] == [r.output_text for r in ours]


@pytest.mark.slow
def test_loglikelihood_vllm_agrees_with_the_cpu_engine(vllm_engine, hf_engine, tiny_path):
    """The same rows (sweeps/data/mc.jsonl, tokenized as the actors do) through vLLM (bf16, prompt_logprobs)
    and the CPU engine (fp32, from the logits). Tolerance: bf16 keeps 8 bits of mantissa (a relative
    rounding of 2^-9 per value), which moves a log-softmax by a few hundredths of a nat per token over four
    layers; a mean above 0.05 nats per token or any token above 0.25 would be a wrong token or position, not
    rounding (those move a byte-vocabulary token's log-probability by nats)."""
    from transformers import AutoTokenizer

    from actors.engine import LoglikRequest
    from cluster.contracts.loglikelihood import encode_pairs

    rows = [json.loads(line) for line in open(ROOT / "sweeps" / "data" / "mc.jsonl")]
    contexts = [f"Question: {r['question']}\nAnswer:" for r in rows]
    encoded = encode_pairs(contexts, [r["choices"] for r in rows], AutoTokenizer.from_pretrained(tiny_path), True)
    requests = [LoglikRequest(str(i), ctx, conts) for i, (ctx, conts) in enumerate(encoded)]
    gpu, cpu = vllm_engine.loglikelihood(requests), hf_engine.loglikelihood(requests)
    per_token = [abs(a - b) / len(c) for g, h, (_, conts) in zip(gpu, cpu, encoded)
                 for a, b, c in zip(g.logprobs, h.logprobs, conts)]
    argmax = [max(range(4), key=r.logprobs.__getitem__) for r in gpu], [max(range(4), key=r.logprobs.__getitem__) for r in cpu]
    same = sum(a == b for a, b in zip(*argmax))
    print(f"loglikelihood vLLM bf16 vs CPU fp32 over {len(rows)} rows x 4 choices: max {max(per_token):.4f} "
          f"mean {sum(per_token) / len(per_token):.4f} nats per token; argmax choice the same in {same} of {len(rows)}")
    assert sum(per_token) / len(per_token) <= 0.05 and max(per_token) <= 0.25
    assert all(len(r.greedy) == 4 for r in gpu)


@pytest.mark.slow
def test_loglikelihood_reads_each_context_once_with_the_numbers_of_computing_it_every_time(vllm_engine, tiny_path):
    """48 rows of a shared 5-shot prefix (about 1,000 byte tokens), each its own question, four choices: scored
    reading the prefix cache (the engine's default), then each request alone with the cache not read (what
    vLLM does for prompt log-probabilities by default, and lm-eval's vLLM backend gets). Some contexts end
    on a 16-token block boundary, where a sibling's cached block covers the context's last position: those
    choices run again, not read short. The values agree within bf16 rounding (tolerance as the test above),
    the choice is the same except where lm-eval's own two best choices are within 0.05 nats, and the engine
    computes under half the tokens it was asked."""
    import random

    from transformers import AutoTokenizer

    from actors.engine import LoglikRequest

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    rng = random.Random(5)

    def words(n: int) -> str:
        return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(n))

    prefix = "".join(f"Question: {words(25)}\nAnswer: {words(3)}\n\n" for _ in range(5))
    requests = []
    for i in range(48):
        ctx = tokenizer.encode(prefix + f"Question: {words(rng.randint(5, 30))}\nAnswer:", add_special_tokens=False)
        if i % 4 == 0:
            ctx = ctx[:len(ctx) - len(ctx) % 16]  # the context ends on a block boundary
        requests.append(LoglikRequest(str(i), ctx, [tokenizer.encode(" " + words(rng.randint(1, 4)),
                                                                     add_special_tokens=False) for _ in range(4)]))
    reused = vllm_engine.loglikelihood(requests)
    alone = [vllm_engine._prompt_tails([(r.context_ids + c, len(c))], read_cache=False)
             for r in requests for c in r.continuations]
    asked = sum(len(r.context_ids) + len(c) for r in requests for c in r.continuations)
    computed = sum(r.computed_tokens for r in reused)
    per_token, differ, k = [], [], 0
    for r, got in zip(requests, reused):
        ref = [sum(lp for lp, _ in alone[k + j][0].scores[-len(c):]) for j, c in enumerate(r.continuations)]
        k += len(r.continuations)
        per_token += [abs(a - b) / len(c) for a, b, c in zip(got.logprobs, ref, r.continuations)]
        best = sorted(range(4), key=lambda j: -ref[j])
        if max(range(4), key=got.logprobs.__getitem__) != best[0]:
            differ.append(ref[best[0]] - ref[best[1]])
    print(f"loglikelihood with the prefix cache read vs every request alone: {len(requests)} rows x 4 choices, "
          f"max {max(per_token):.4f} mean {sum(per_token) / len(per_token):.4f} nats per token; choice differs in "
          f"{len(differ)} (margins {differ}); tokens computed {computed} of {asked} asked")
    assert sum(per_token) / len(per_token) <= 0.05 and max(per_token) <= 0.25
    assert all(margin < 0.05 for margin in differ)
    assert computed < asked / 2


def test_an_integer_compilation_config_starts_the_engine_in_that_mode(tiny_path):
    """`compilation_config: 0` in a spec's engine is vLLM's mode 0 (no torch.compile), as `LLM(compilation_config=0)`
    reads it: the engine starts without compiling and generates every request to its length."""
    from actors.engine import EngineProfile, GenRequest
    from actors.vllm_args import engine_args
    from actors.vllm_engine import VllmEngine
    from cluster.contracts.spec import ModelSpec, SamplingSpec

    model = ModelSpec("tiny", "builtin:tiny", engine={"gpu_memory_utilization": 0.2, "compilation_config": 0})
    assert engine_args(model, tiny_path, EngineProfile(), 1.0)["compilation_config"]["mode"] == 0
    engine = VllmEngine(model, tiny_path, EngineProfile(), exit_on_error=False)
    try:
        info = engine.startup()
        print("compilation_config 0 engine start:", json.dumps(info))
        assert info["compile_s"] is None and info["fallback_reason"] is None
        out = engine.generate([GenRequest(str(i), list(f"Question {i}:".encode()), i) for i in range(8)],
                              SamplingSpec(max_tokens=8), None)
        assert all(r.output_tokens == 8 and r.finish_reason == "length" for r in out)
    finally:
        engine.close()


@pytest.mark.slow
def test_an_uncompiled_engine_scores_as_the_compiled_one_and_generates_in_its_graphs(vllm_engine, tiny_path):
    """The start a model over 2 GiB gets by itself (actors/vllm_args.py UNCOMPILED: no torch.compile, full CUDA
    graphs for decode steps only), asked of builtin:tiny by its spec, beside the compiled engine: its graphs
    captured (FULL), no torch.compile seconds; the multiple-choice rows' log-likelihoods within bf16 rounding of the
    compiled engine's (the tolerance of the tests above) and the same choice except where the compiled engine's two
    best are within 0.05 nats; greedy generation of every request to its length."""
    from transformers import AutoTokenizer

    from actors.engine import EngineProfile, GenRequest, LoglikRequest
    from actors.vllm_args import UNCOMPILED
    from actors.vllm_engine import VllmEngine
    from cluster.contracts.loglikelihood import encode_pairs
    from cluster.contracts.spec import ModelSpec, SamplingSpec

    engine = VllmEngine(ModelSpec("tiny", "builtin:tiny", engine={"gpu_memory_utilization": 0.3,
                                                                  "compilation_config": dict(UNCOMPILED)}),
                        tiny_path, EngineProfile(), exit_on_error=False)
    try:
        info = engine.startup()
        print("uncompiled engine start:", json.dumps(info))
        assert info["cuda_graphs"] and info["graph_mode"] == "FULL" and info["fallback_reason"] is None
        assert info["compile_s"] is None and info["graph_capture_s"] is not None
        rows = [json.loads(line) for line in open(ROOT / "sweeps" / "data" / "mc.jsonl")]
        contexts = [f"Question: {r['question']}\nAnswer:" for r in rows]
        encoded = encode_pairs(contexts, [r["choices"] for r in rows], AutoTokenizer.from_pretrained(tiny_path), True)
        requests = [LoglikRequest(str(i), ctx, conts) for i, (ctx, conts) in enumerate(encoded)]
        ours, compiled = engine.loglikelihood(requests), vllm_engine.loglikelihood(requests)
        per_token, differ = [], []
        for got, ref, (_, conts) in zip(ours, compiled, encoded):
            per_token += [abs(a - b) / len(c) for a, b, c in zip(got.logprobs, ref.logprobs, conts)]
            best = sorted(range(len(conts)), key=lambda j: -ref.logprobs[j])
            if max(range(len(conts)), key=got.logprobs.__getitem__) != best[0]:
                differ.append(ref.logprobs[best[0]] - ref.logprobs[best[1]])
        print(f"loglikelihood uncompiled vs compiled over {len(rows)} rows: max {max(per_token):.4f} mean "
              f"{sum(per_token) / len(per_token):.4f} nats per token; choice differs in {len(differ)} (margins {differ})")
        assert sum(per_token) / len(per_token) <= 0.05 and max(per_token) <= 0.25
        assert all(margin < 0.05 for margin in differ)
        reqs = [GenRequest(str(i), list(f"Question {i}: what?".encode()), i) for i in range(32)]
        out = engine.generate(reqs, SamplingSpec(max_tokens=16), None)
        same = sum(a.output_text == b.output_text
                   for a, b in zip(out, vllm_engine.generate(reqs, SamplingSpec(max_tokens=16), None)))
        print(f"greedy outputs equal to the compiled engine's: {same} of {len(reqs)}")
        assert all(r.output_tokens == 16 and r.finish_reason == "length" for r in out)
    finally:
        engine.close()


@pytest.mark.slow
def test_scoring_sweep_on_vllm(ray_local, tmp_path):
    """sweeps/scoring.yaml with vLLM: loglikelihood, four sampled completions per problem run in the
    sandbox, and the replayed task; every row once, every completion with its own seed."""
    import pyarrow.parquet as pq
    import yaml

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    raw = yaml.safe_load((ROOT / "sweeps" / "scoring.yaml").read_text())
    raw["output"] = str(tmp_path / "out")
    raw["models"][0]["engine"] = {"backend": "vllm", "gpu_memory_utilization": 0.3}
    for task in raw["tasks"]:
        task["data"] = str(ROOT / "sweeps" / task["data"])
    (tmp_path / "scoring.yaml").write_text(yaml.safe_dump(raw))
    report = run_sweep(load_spec(tmp_path / "scoring.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    print(pq.read_table(tmp_path / "out" / "summary.parquet").to_pandas().to_string())
    assert len(results) == 40 + 8 * 4 + 8 * 3
    assert not results.duplicated(["model", "task", "sample_id", "completion"]).any()
    code = results[results.task == "code"]
    assert code.exec_status.notna().all() and code.groupby("sample_id").output_text.nunique().min() > 1
    assert results[results.task == "mc"].choice_logprobs.map(len).eq(4).all()


@pytest.mark.slow
def test_reproducible_sweep_repeats_across_shard_sizes_and_actors_on_vllm(ray_local, tmp_path):
    """`reproducible: true` on vLLM: 400 prompts, greedy, one actor in shards of 128 and two actors sharing
    the GPU in shards of 16 give the same outputs, every one."""
    import pyarrow.parquet as pq

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec
    from benchmarks.common import prompts_of

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n"
                            for i, t in enumerate(prompts_of(400, 64, 1024, seed=13))))

    def run(name: str, actors: dict, shard: int) -> dict:
        spec = {"name": name, "output": str(tmp_path / name), "reproducible": True,
                # 0.3 of the GPU each: the module's vllm_engine (0.3) may still hold its share
                "models": [{"name": "tiny", "path": "builtin:tiny",
                            "engine": {"backend": "vllm", "gpu_memory_utilization": 0.3}}],
                "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "{text}",
                           "sampling": {"max_tokens": 32, "temperature": 0.0}}],
                "shards": {"max_samples": shard}, "actors": actors}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(spec))
        assert not run_sweep(load_spec(tmp_path / f"{name}.yaml"), log=print).failed
        rows = pq.read_table(tmp_path / name / "results", columns=["sample_id", "output_text"]).to_pylist()
        return {r["sample_id"]: r["output_text"] for r in rows}

    one = run("one", {"count": 1, "num_gpus": 1}, 128)
    two = run("two", {"count": 2, "num_gpus": 0.5}, 16)
    same = sum(one[k] == two[k] for k in one)
    print(f"reproducible: {same} of {len(one)} outputs equal between (1 actor, shards of 128) and (2 actors, shards of 16)")
    assert len(one) == len(two) == 400 and same == 400


@pytest.mark.slow
def test_a_checkpoint_after_another_on_one_vllm_engine_gives_its_own_rows(tmp_path, tiny_path):
    """Two checkpoints of builtin:tiny's shape (its weights, and those moved by noise) on one whole GPU, with
    `reproducible: true`: the actor's engine runs the first, then has the second's weights loaded into it (reason
    `weights`: no new engine); the second's rows, generation and log-likelihood, are those of the second run alone
    by the same command, every one. Each engine takes a third of the GPU's memory: the module's shared engine
    (`vllm_engine`) may hold another."""
    import os

    import pyarrow.parquet as pq

    from tests.test_weight_swap import checkpoint

    paths = {"a": checkpoint(tiny_path, tmp_path / "ckpt-a"), "b": checkpoint(tiny_path, tmp_path / "ckpt-b", seed=1)}
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "text": f"sample number {i} says", "label": i % 3,
                                        "choices": [" yes", " no", " maybe"]}) + "\n" for i in range(64)))
    one_gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]

    def run(name: str, models: list[str]) -> dict:
        spec = {"name": name, "reproducible": True,
                "models": [{"name": m, "path": str(paths[m]),
                            "engine": {"backend": "vllm", "gpu_memory_utilization": 0.3}} for m in models],
                "tasks": [{"name": "gen", "data": str(data), "id_column": "id", "prompt": "{text}",
                           "sampling": {"max_tokens": 16}},
                          {"name": "mc", "type": "loglikelihood", "data": str(data), "id_column": "id",
                           "prompt": "{text}:", "choices": "choices", "target": "label"}],
                "shards": {"max_samples": 16}, "actors": {"count": 1, "num_gpus": 1}}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(spec))
        _local_command(tmp_path / f"{name}.yaml", tmp_path / name,
                       env={"CUDA_VISIBLE_DEVICES": one_gpu})
        rows = pq.read_table(tmp_path / name / "results").to_pylist()
        return {(r["model"], r["task"], r["sample_id"]): (r["output_text"], r["choice_logprobs"]) for r in rows}

    both = run("both", ["a", "b"])
    starts = pq.read_table(tmp_path / "both" / "telemetry" / "actors.parquet").to_pandas()
    print(starts[["model", "reason", "startup_s", "engine_init_s", "weights_s", "compile_s", "graph_mode"]].to_string())
    assert list(starts["reason"]) == ["first", "weights"] and starts["actor_id"].nunique() == 1
    first, second = starts["model"]
    alone = run("alone", [second])
    same = sum(both.get(key) == value for key, value in alone.items())
    print(f"weights loaded into the engine: {same} of {len(alone)} rows of checkpoint {second} equal to it run alone")
    assert len(alone) == 128 and same == 128
    assert sum(both[(first, *key[1:])] == value for key, value in alone.items()) < 128  # the first's engine differs
