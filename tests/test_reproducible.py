"""Results that repeat (CPU, the CPU engine, real Ray):
- raysweep hands the engine the token ids and sampling settings a plain `vllm.LLM.generate` over the prompt
  strings would use (vLLM 0.26: `tokenizer(prompt, add_special_tokens=True)["input_ids"]`, renderers/base.py;
  SamplingParams' defaults, sampling_params.py);
- with `reproducible: true`, greedy and seeded outputs are identical whatever the shard size and actor count,
  and across a driver killed at about half and resumed;
- `raysweep verify` reports every sampled row matching, and a row whose result file was altered;
- a resume never mixes reproducible and non-reproducible results."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import QUICKSTART, ROOT, first_rows, prepare_file
from tests.test_ray_output import RAY_LINE
from tests.test_reliability import committed, outputs, wait_for

PROMPTS = ["Question: 2+2?\nAnswer:", "  leading and trailing spaces  ", "naïve café — ünïcödé ✓ 日本語",
           "tabs\tand\nnewlines\n\n", "x" * 500, "<|user|>special-looking text<|end|>"]


def test_token_ids_are_those_a_plain_vllm_generate_would_use(tiny_path):
    from transformers import AutoTokenizer

    from actors.engine import GenResult
    from actors.shard_work import run_rows
    from cluster.contracts.tokens import tokenize
    from cluster.contracts.spec import TaskSpec

    class Recorder:  # an engine that keeps what the actor hands it
        def generate(self, requests, sampling, structured):
            self.ids = [r.prompt_token_ids for r in requests]
            return [GenResult(r.sample_id, "", 0, "stop", None, None) for r in requests]

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    plain = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in PROMPTS]  # what vLLM's renderer calls
    assert tokenize(PROMPTS, tokenizer, add_special_tokens=True) == plain  # the driver's measure
    rows = [{"sample_id": str(i), "prompt": p, "prompt_token_ids": None, "prompt_tokens": len(ids), "seed": i,
             "status": "ok"} for i, (p, ids) in enumerate(zip(PROMPTS, plain))]
    engine = Recorder()  # the actor's own tokenization of a shard's rows
    run_rows(engine, rows, TaskSpec("t", "d.jsonl", prompt="{q}"), tokenizer, add_special_tokens=True)
    assert engine.ids == plain


def test_sampling_settings_are_a_plain_scripts_with_vllms_defaults():
    from actors.vllm_args import sampling_kwargs
    from cluster.contracts.spec import SamplingSpec

    # the plain script: SamplingParams(max_tokens=N, temperature=0.0); vLLM 0.26's defaults for the rest
    plain = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": None, "seed": None,
             "structured_outputs": None}
    assert sampling_kwargs(SamplingSpec(max_tokens=64), seed=123, structured=None) == plain
    sampled = sampling_kwargs(SamplingSpec(max_tokens=8, temperature=0.7, stop=("\n",)), seed=5, structured=None)
    # a seed per sample: vLLM then never draws with FlashInfer's sampler (actors/vllm_args.py ENGINE_ENV)
    assert sampled == dict(plain, max_tokens=8, temperature=0.7, stop=["\n"], seed=5)


def test_reproducible_engine_arguments_are_the_batch_invariant_setting():
    """`reproducible: true` gives vLLM the setting measured batch-invariant on an H100 (TRITON_ATTN, no prefix
    caching, no chunked prefill, graphs and compile on), for long shards too, over what the spec's engine says."""
    from actors.engine import EngineProfile
    from actors.vllm_args import REPRODUCIBLE_ARGS, engine_args
    from cluster.contracts.spec import ModelSpec

    model = ModelSpec("m", "/m", engine={"max_num_seqs": 32, "attention_config": {"backend": "TRITON_ATTN"}})
    for profile in (EngineProfile(), EngineProfile("long", True, 2048)):
        args = engine_args(model, "/m", profile, 1.0, reproducible=True)
        assert {k: args[k] for k in REPRODUCIBLE_ARGS} == REPRODUCIBLE_ARGS
        assert "max_num_batched_tokens" not in args and "enforce_eager" not in args
    plain = engine_args(ModelSpec("m", "/m"), "/m", EngineProfile("long", True, 2048), 1.0)
    assert plain["enable_chunked_prefill"] is True and "attention_config" not in plain


def spec_file(tmp_path, name: str, reproducible: bool = True, max_samples: int = 50, count: int = 1,
              rows: int | None = None) -> str:
    """The quickstart's greedy and seeded tasks (not the chat one: the slowest on the CPU engine); `rows`: only
    each task's first rows."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw.update(name=name, reproducible=reproducible, output=str(tmp_path / name),
               shards={"max_samples": max_samples}, actors={"count": count, "num_cpus": 1})
    raw["tasks"] = [t for t in raw["tasks"] if t["name"] in ("arithmetic", "choice")]
    for task in raw["tasks"]:
        task["data"] = str(QUICKSTART.parent / task["data"])
        if rows is not None:
            task["data"] = str(first_rows(Path(task["data"]), rows, tmp_path / f"{task['name']}-{rows}.jsonl"))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def sweep(*args: str, address: str = "local") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=os.environ | {"RAY_ADDRESS": address})


@pytest.mark.slow
def test_reproducible_outputs_repeat_across_shards_actors_and_a_resume_and_verify_checks_them(ray_local, tmp_path):
    # each task's first 64 rows (128 in all; the suite's slowest test with all 250). Every run below joins the
    # session's local Ray (its 2 CPUs: the resumed run's two actors) rather than starting one of its own: 4 s each
    address = ray_local.get_runtime_context().gcs_address
    done = sweep("run", spec_file(tmp_path, "big", max_samples=64, count=1, rows=64), address=address)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    big = outputs(tmp_path / "big")
    assert len(big) == 128

    # other shards (of 4: 32 of them) on two actors, killed after 10 or more are committed, then resumed: the
    # same outputs as one actor's shards of 64
    spec, out = spec_file(tmp_path, "resumed", max_samples=4, count=2, rows=64), tmp_path / "resumed"
    driver = subprocess.Popen([sys.executable, "-m", "jobs.sweep", spec], cwd=ROOT, start_new_session=True,
                              env=os.environ | {"RAY_ADDRESS": address}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: committed(out) >= 10), "the sweep never committed a shard"
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.wait(timeout=60)
    assert 10 <= committed(out) < 32
    # the killed driver's actors go with it, as Ray notices its death: the resume takes their names once they are gone
    assert wait_for(lambda: not any(a.get("namespace") == "raysweep-resumed"
                                    for a in ray_local.util.list_named_actors(all_namespaces=True))), \
        "the killed driver's actors stayed"
    again = sweep("run", spec, address=address)
    assert again.returncode == 0 and "resuming:" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert outputs(out) == big
    assert json.loads((out / "manifest.json").read_text())["reproducible"] is True
    for run in (tmp_path / "big", out):  # the CPU engine's: forked from each command's engine host, as in any run
        engines = pq.read_table(run / "telemetry" / "actors.parquet", columns=["engine_process"])
        assert set(engines["engine_process"].to_pylist()) == {"host"}

    # verify, once: one committed results file altered (every output of it), then 40 rows sampled and generated
    # again: the sampled rows of that file differ and are named, every other sampled row matches
    part = sorted((tmp_path / "big" / "results" / "tiny" / "arithmetic").glob("*.parquet"))[0]
    table = pq.read_table(part)
    altered = {("arithmetic", sid) for sid in table["sample_id"].to_pylist()}
    column = table.schema.get_field_index("output_text")
    pq.write_table(table.set_column(column, "output_text", __import__("pyarrow").array(
        [text + " (altered)" for text in table["output_text"].to_pylist()])), part)
    kept = tmp_path / "verify-kept"
    check = sweep("verify", str(tmp_path / "big"), "--samples", "40", "--keep", str(kept), "--verbose", address=address)
    assert check.returncode == 1, check.stdout[-2000:] + check.stderr[-2000:]
    assert f"[raysweep] results: {kept / 'output'}\n" in check.stdout  # --keep: the rows generated again stay
    sampled = {(r["task"], r["sample_id"]) for r in
               pq.read_table(kept / "output" / "results", columns=["task", "sample_id"]).to_pylist()}
    assert len(sampled) == 40
    differ = set(re.findall(r"verify: DIFFERS tiny/(\w+)/(\S+): committed", check.stdout))
    assert differ == sampled & altered and 0 < len(differ) < 40, check.stdout[-3000:]
    assert f"verify: {40 - len(differ)} of 40 sampled outputs match (reproducible: true" in check.stdout
    assert RAY_LINE.search(check.stderr), check.stderr[-2000:]  # --verbose: Ray's own lines too


def _commit_one_row(spec_path: str) -> None:
    """A reproducible spec's output with one committed shard of one row, its sink closed."""
    import pyarrow as pa

    from cluster.inputs.spec_file import load_spec

    prepared = prepare_file(spec_path)
    prepared.sink.plan(["tiny/arithmetic/00000"])
    one_row = pa.table({"sample_id": ["a0"], "model": ["tiny"], "task": ["arithmetic"], "status": ["ok"],
                        "score": [1.0], "structured_valid": pa.array([None], pa.bool_()), "output_tokens": [3]})
    prepared.sink.commit("tiny/arithmetic/00000", "tiny", "arithmetic", 0, one_row, 1)
    prepared.sink.close()


def test_a_resume_never_mixes_reproducible_and_other_results(tmp_path):
    from cluster.store.output_files import SinkError
    from cluster.inputs.spec_file import load_spec

    _commit_one_row(spec_file(tmp_path, "mixed"))
    with pytest.raises(SinkError, match="made with reproducible: true; this spec says reproducible: false"):
        prepare_file(spec_file(tmp_path, "mixed", reproducible=False))


def test_a_resume_never_adds_to_reproducible_results_of_another_setting(tmp_path):
    """An output made under another `reproducible: true` setting (an earlier raysweep's: FLASH_ATTN, prefix
    caching) is refused, as the mode's flag alone would not tell."""
    import json

    from cluster.store.output_files import SinkError
    from cluster.inputs.spec_file import load_spec

    _commit_one_row(spec_file(tmp_path, "older"))
    prepare_file(spec_file(tmp_path, "older")).sink.close()  # the same setting resumes
    manifest = tmp_path / "older" / "manifest.json"
    older = json.loads(manifest.read_text())
    del older["reproducible_setting"]  # as a raysweep before this one wrote it
    manifest.write_text(json.dumps(older))
    with pytest.raises(SinkError, match="holds reproducible results made with another setting \\(one from before"):
        prepare_file(spec_file(tmp_path, "older"))
    from cluster.store.manifest import EARLIER_REPRODUCIBLE_SETTING

    manifest.write_text(json.dumps(dict(older, reproducible_setting=EARLIER_REPRODUCIBLE_SETTING)))
    with pytest.raises(SinkError, match="made with another setting \\(vLLM batch-invariant mode .* on\\); this raysweep"):
        prepare_file(spec_file(tmp_path, "older"))  # its CPU log-likelihoods differ by float32 steps


@pytest.mark.parametrize("engine, message", [
    ({"compilation_config": {"cudagraph_mode": "NONE"}}, "a compilation_config that turns CUDA graphs or torch.compile"),
    ({"compilation_config": {"mode": 0}}, "a compilation_config that turns CUDA graphs or torch.compile"),
    ({"tensor_parallel_size": 2}, "an engine across 2 GPUs (tensor/pipeline parallel): the batch-invariant setting "
                                  "was measured on one GPU only"),
])
def test_reproducible_refuses_eager_by_compilation_config_and_engines_across_gpus(tmp_path, engine, message):
    from cluster.contracts.errors import PreflightError
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.spec_file import load_spec

    path = spec_file(tmp_path, "refused")
    raw = yaml.safe_load(open(path))
    raw["models"][0]["engine"] = engine
    open(path, "w").write(yaml.safe_dump(raw))
    with pytest.raises(PreflightError) as err:
        check_inputs(load_spec(path))
    assert str(err.value).startswith(f"{path}: model tiny: reproducible: true cannot run with {message}")
