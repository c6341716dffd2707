"""Bench parts (a)-(d): ratios of one engine setting to another, on one GPU, one model and one prompt set.

(a) raysweep sweep output tok/s ÷ one raw `vllm.LLM.generate` over the same prompts, seeds and sampling
    (variable-length outputs: temperature 1 with stop strings). raysweep's rate is measured over the span
    from its first shard's start to its last shard's end (engines warm, like the raw call); its whole
    wall time, Ray and engine start included, is reported beside it. `--repeats N` runs it all N times
    (raw runs alone vary by a few percent); `--in-flight auto,8` compares shards-in-flight settings.
(b) CUDA graphs ÷ eager: single-stream decode, and a 256-prompt batch (fixed length: ignore_eos).
(c) a long shard (prompts of 12-16k tokens) with chunked prefill vs without: throughput, peak GPU memory
    (NVML) and the KV-cache blocks vLLM could allocate.
(d) guided (JSON schema, xgrammar) ÷ free generation on the same prompts.
Run through `python -m benchmarks --parts a,b,c,d`; each part records its figures on the `Bench` it is given.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.common import Bench, prompts_of

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11} [A-Z][a-z]{1,11}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"}}}


def part_a(bench: Bench) -> None:
    """raysweep vs raw vLLM on the same prompts, seeds and sampling: for each repeat, one sweep per
    shards-in-flight setting, then one raw call on a fresh engine. The mean batch (requests the engine
    held per step, capped at max_num_seqs) is read the same way for both: raysweep's from its shard
    telemetry (engine_batch_mean), the raw call's by counting around `LLMEngine.step`."""
    data = bench.out / "a_prompts.jsonl"
    with open(data, "w") as f:
        for i, p in enumerate(bench.prompts):
            f.write(json.dumps({"id": f"p{i:05d}", "text": p}) + "\n")
    ratios: dict[str, list[float]] = {}
    for r in range(bench.repeats):
        sweeps = {depth: _sweep_rate(bench, data, depth, f"a_results_r{r}_{depth}") for depth in bench.in_flight}
        raw_rate, raw_batch, lengths = _raw_rate(bench)
        bench.record("a", f"r{r} raw_tok_per_s", raw_rate, "tok/s")
        bench.record("a", f"r{r} raw_batch_mean", raw_batch, "requests per step")
        bench.record("a", f"r{r} output_len_p10_p50_p90", None,
                     f"{lengths[len(lengths)//10]}/{lengths[len(lengths)//2]}/{lengths[9*len(lengths)//10]}")
        for depth, (rate, whole, batch, tokens) in sweeps.items():
            bench.record("a", f"r{r} in_flight={depth} raysweep_tok_per_s_span", rate, f"tok/s ({tokens} tok)")
            bench.record("a", f"r{r} in_flight={depth} raysweep_tok_per_s_whole_run", whole,
                         "tok/s (Ray + engine start included)")
            bench.record("a", f"r{r} in_flight={depth} raysweep_batch_mean", batch,
                         "requests per step (median over shards)")
            bench.record("a", f"r{r} in_flight={depth} ratio raysweep/raw", rate / raw_rate, "x")
            ratios.setdefault(depth, []).append(rate / raw_rate)
    for depth, values in ratios.items():
        bench.record("a", f"in_flight={depth} RATIO raysweep/raw, mean of {len(values)}",
                     sum(values) / len(values), f"x (min {min(values):.3f}, max {max(values):.3f})")


def _sweep_rate(bench: Bench, data: Path, depth: str, name: str) -> tuple[float, float, float | None, int]:
    """One raysweep run over (a)'s prompts: tok/s over the shards' span, over the whole run, the
    median engine batch, and the output tokens."""
    import pyarrow.parquet as pq
    import ray

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    spec_path = bench.out / f"{name}.yaml"
    actors = {"count": 1, "num_gpus": 1, **({} if depth == "auto" else {"shards_in_flight": int(depth)})}
    spec_path.write_text(json.dumps({
        "name": "bench-a", "output": str(bench.out / name),
        "models": [{"name": "m", "path": bench.model_path, "engine": {"backend": "vllm", **bench.engine_overrides}}],
        "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "{text}",
                   "sampling": {"max_tokens": 256, "temperature": 1.0, "seed": 5, "stop": [".", "\n"]}}],
        "shards": {"max_samples": bench.shard_size}, "actors": actors}))
    spec = load_spec(spec_path)
    started = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        report = run_sweep(spec, log=lambda line: None)
    finally:
        ray.shutdown()
    whole = time.perf_counter() - started
    assert not report.failed, report.failed
    shards = pq.read_table(bench.out / name / "telemetry" / "shards.parquet").to_pandas()
    span = (shards["finished_at"].max() - shards["started_at"].min()).total_seconds()
    tokens = int(shards["output_tokens"].sum())
    return tokens / span, tokens / whole, shards["engine_batch_mean"].median(), tokens


def _raw_rate(bench: Bench) -> tuple[float, float, list[int]]:
    """One raw `LLM.generate` over (a)'s prompts on a fresh, warmed engine: tok/s, the mean batch
    per step, and the sorted output lengths."""
    from vllm import SamplingParams

    from cluster.contracts.shard import sample_seed

    llm = bench.llm()
    prompts = bench.token_prompts(llm, bench.prompts)
    params = [SamplingParams(max_tokens=256, temperature=1.0, stop=[".", "\n"],
                             seed=sample_seed(5, "t", f"p{i:05d}")) for i in range(bench.n)]
    bench.timed_generate(llm, prompts[:32], params[:32])  # warm-up, as raysweep's engine is warm too
    engine, held = llm.llm_engine, []
    cap, step = int(engine.vllm_config.scheduler_config.max_num_seqs), engine.step

    def counting_step():
        held.append(min(engine.get_num_unfinished_requests(), cap))
        return step()

    engine.step = counting_step  # LLM.generate steps through this attribute
    wall, tokens, outs = bench.timed_generate(llm, prompts, params)
    bench.free(llm)
    return tokens / wall, sum(held) / len(held), sorted(len(o.outputs[0].token_ids) for o in outs)


def part_b(bench: Bench) -> None:
    """CUDA graphs vs eager: one request decoding, and 256 prompts at once (fixed lengths)."""
    from vllm import SamplingParams

    single = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    batch = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    rates = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        llm = bench.llm(enforce_eager=eager)
        prompts = bench.token_prompts(llm, prompts_of(256, 32, 256, seed=2))
        bench.timed_generate(llm, prompts[:8], batch)  # warm-up
        wall, tokens, _ = bench.timed_generate(llm, prompts[:1], single)
        rates[(mode, "single")] = tokens / wall
        wall, tokens, _ = bench.timed_generate(llm, prompts, batch)
        rates[(mode, "batch256")] = tokens / wall
        bench.free(llm)
        for kind in ("single", "batch256"):
            bench.record("b", f"{mode}_{kind}_tok_per_s", rates[(mode, kind)], "tok/s")
    for kind in ("single", "batch256"):
        bench.record("b", f"RATIO graphs/eager {kind}", rates[("graphs", kind)] / rates[("eager", kind)], "x")


def part_c(bench: Bench) -> None:
    """A long shard with chunked prefill (chunk 2,048) vs without (one prompt per step budget)."""
    from vllm import SamplingParams

    from actors.engine import EngineProfile
    from actors.telemetry import GpuSampler

    texts = prompts_of(32, 12_000, 16_000, seed=3)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    results = {}
    for mode, profile in (("chunked", EngineProfile("long", True, 2048)), ("unchunked", EngineProfile())):
        llm = bench.llm(profile=profile, engine={"max_model_len": 16_384})
        prompts = bench.token_prompts(llm, texts)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        bench.timed_generate(llm, prompts[:2], params)  # warm-up
        with GpuSampler(interval_s=0.1) as gpu:
            wall, out_tokens, outs = bench.timed_generate(llm, prompts, params)
        in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        results[mode] = (in_tokens + out_tokens) / wall
        bench.free(llm)
        bench.record("c", f"{mode}_total_tok_per_s", results[mode], "tok/s (prompt + output)")
        bench.record("c", f"{mode}_peak_gpu_mem_mib", gpu.aggregates()["gpu_mem_used_max_mib"], "MiB (NVML)")
        bench.record("c", f"{mode}_kv_cache_blocks", blocks, "blocks")
    bench.record("c", "RATIO chunked/unchunked throughput", results["chunked"] / results["unchunked"], "x")


def part_d(bench: Bench) -> None:
    """Guided (JSON schema through xgrammar) vs free generation, same engine and prompts. Guided
    outputs are short JSON objects; free text runs to a newline, so its outputs are longer and its
    prefill is spread over more output tokens. The ratio is therefore taken at equal work: free
    generation again with each request's max_tokens = its guided output's length (ignore_eos), so
    both runs compute the same prompts and the same number of output tokens per request."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from cluster.contracts.spec import StructuredSpec
    from cluster.contracts.structured import is_valid

    llm = bench.llm()
    prompts = bench.token_prompts(llm, bench.prompts)
    natural = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, stop=["\n"]) for i in range(bench.n)]
    guided = [SamplingParams(max_tokens=96, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(bench.n)]
    bench.timed_generate(llm, prompts[:32], guided[:32])  # warm-up, grammar compiled
    wall_n, tok_n, _ = bench.timed_generate(llm, prompts, natural)
    wall_g, tok_g, outs = bench.timed_generate(llm, prompts, guided)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    same = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    wall_f, tok_f, _ = bench.timed_generate(llm, prompts, same)
    valid = sum(is_valid(StructuredSpec("json_schema", SCHEMA), o.outputs[0].text) for o in outs)
    bench.free(llm)
    bench.record("d", "free_to_newline_tok_per_s", tok_n / wall_n, f"tok/s ({tok_n / bench.n:.0f} tok per output)")
    bench.record("d", "free_same_lengths_tok_per_s", tok_f / wall_f, f"tok/s ({tok_f / bench.n:.0f} tok per output)")
    bench.record("d", "guided_tok_per_s", tok_g / wall_g, f"tok/s ({tok_g / bench.n:.0f} tok per output)")
    bench.record("d", "guided_valid", valid / bench.n, "fraction")
    bench.record("d", "ratio guided/free-to-newline", (tok_g / wall_g) / (tok_n / wall_n), "x (unequal work)")
    bench.record("d", "RATIO guided/free", (tok_g / wall_g) / (tok_f / wall_f), "x (same prompts, same output lengths)")


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
