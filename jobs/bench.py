"""GPU benchmark: ratios measured in one run, on one GPU, one model and one prompt set.

    python -m jobs.bench --model builtin:small --parts a,b,c,d --out bench/out

(a) raysweep sweep output tok/s ÷ one raw `vllm.LLM.generate` over the same prompts, seeds and sampling
    (variable-length outputs: temperature 1 with stop strings). raysweep's rate is measured over the span
    from its first shard's start to its last shard's end (engines warm, like the raw call); its whole
    wall time, Ray and engine start included, is reported beside it. `--repeats N` runs it all N times
    (raw runs alone vary by a few percent); `--in-flight auto,8` compares shards-in-flight settings.
(b) CUDA graphs ÷ eager: single-stream decode, and a 256-prompt batch (fixed length: ignore_eos).
(c) a long shard (prompts of 12-16k tokens) with chunked prefill vs without: throughput, peak GPU memory
    (NVML) and the KV-cache blocks vLLM could allocate.
(d) guided (JSON schema, xgrammar) ÷ free generation on the same prompts.
(e) whole processes, start to exit: raysweep ÷ a plain vLLM script ÷ Ray Data LLM, and several models in
    one sweep ÷ the plain script once per model (jobs/bench_e2e.py; flags --e-*).
(x) diagnostic for (a), one engine: raw `generate` in the bench's order and in raysweep's (sorted by
    prompt length), then raysweep's VllmEngine (its engine thread, no Ray) in one batch and in shards.
(y) diagnostic for (a), continued: that engine thread inside a Ray actor (1 CPU, 1 GPU, as raysweep's).
(p) planning alone, on CPU: N synthetic prompts of mixed lengths (90% 20-120 characters, 10% 1-2k)
    read, rendered, measured in tokens and cut into shards; cold, then again with the token cache warm.
(o) orchestration alone, on CPU: N synthetic samples through planning, the scheduler, Ray, scoring and
    Parquet commits with the fake engine (answers at once); samples/s and the driver's peak memory.
Each part appends rows (part, metric, value, unit) to OUT/bench.parquet and the run prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11} [A-Z][a-z]{1,11}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"}}}
WORDS = ("the of and to in is was for on that with as by at from his her they this had are but not one "
         "river market signal engine winter garden letter number paper stone").split()


def prompts_of(n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target, words = rng.randint(lo, hi), []
        while sum(len(w) + 1 for w in words) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:target])
    return out


class Bench:
    def __init__(self, model_path: str, out: Path, n_prompts: int):
        self.model_path, self.out, self.n = model_path, out, n_prompts
        self.rows: list[dict] = []
        self.engine_overrides: dict = {}
        self.prompts = prompts_of(n_prompts, 32, 1024, seed=1)

    def record(self, part: str, metric: str, value, unit: str = "") -> None:
        self.rows.append({"part": part, "metric": metric, "value": None if value is None else float(value), "unit": unit})
        print(f"[bench] {part} {metric} = {value} {unit}", flush=True)

    # -- engines -----------------------------------------------------------------------------------
    def llm(self, **overrides):
        from vllm import LLM

        from actors.engine import EngineProfile
        from actors.vllm_engine import engine_args
        from cluster.spec import ModelSpec

        profile = overrides.pop("profile", EngineProfile())
        engine = {**self.engine_overrides, **overrides.pop("engine", {})}
        args = engine_args(ModelSpec("bench", self.model_path, engine=engine),
                           self.model_path, profile, 1.0)
        args.update(overrides)
        return LLM(**args)

    @staticmethod
    def free(llm) -> None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    @staticmethod
    def timed_generate(llm, prompts, params) -> tuple[float, int, list]:
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        return wall, sum(len(o.outputs[0].token_ids) for o in outs), outs

    def token_prompts(self, llm, texts):
        tok = llm.get_tokenizer()
        return [{"prompt_token_ids": tok(t)["input_ids"]} for t in texts]

    # -- parts -------------------------------------------------------------------------------------
    def part_a(self) -> None:
        """raysweep vs raw vLLM on the same prompts, seeds and sampling: for each repeat, one sweep per
        shards-in-flight setting, then one raw call on a fresh engine. The mean batch (requests the engine
        held per step, capped at max_num_seqs) is read the same way for both: raysweep's from its shard
        telemetry (engine_batch_mean), the raw call's by counting around `LLMEngine.step`."""
        data = self.out / "a_prompts.jsonl"
        with open(data, "w") as f:
            for i, p in enumerate(self.prompts):
                f.write(json.dumps({"id": f"p{i:05d}", "text": p}) + "\n")
        ratios: dict[str, list[float]] = {}
        for r in range(self.repeats):
            sweeps = {depth: self._sweep_rate(data, depth, f"a_results_r{r}_{depth}") for depth in self.in_flight}
            raw_rate, raw_batch, lengths = self._raw_rate()
            self.record("a", f"r{r} raw_tok_per_s", raw_rate, "tok/s")
            self.record("a", f"r{r} raw_batch_mean", raw_batch, "requests per step")
            self.record("a", f"r{r} output_len_p10_p50_p90", None,
                        f"{lengths[len(lengths)//10]}/{lengths[len(lengths)//2]}/{lengths[9*len(lengths)//10]}")
            for depth, (rate, whole, batch, tokens) in sweeps.items():
                self.record("a", f"r{r} in_flight={depth} raysweep_tok_per_s_span", rate, f"tok/s ({tokens} tok)")
                self.record("a", f"r{r} in_flight={depth} raysweep_tok_per_s_whole_run", whole,
                            "tok/s (Ray + engine start included)")
                self.record("a", f"r{r} in_flight={depth} raysweep_batch_mean", batch,
                            "requests per step (median over shards)")
                self.record("a", f"r{r} in_flight={depth} ratio raysweep/raw", rate / raw_rate, "x")
                ratios.setdefault(depth, []).append(rate / raw_rate)
        for depth, values in ratios.items():
            self.record("a", f"in_flight={depth} RATIO raysweep/raw, mean of {len(values)}",
                        sum(values) / len(values), f"x (min {min(values):.3f}, max {max(values):.3f})")

    def _sweep_rate(self, data: Path, depth: str, name: str) -> tuple[float, float, float | None, int]:
        """One raysweep run over (a)'s prompts: tok/s over the shards' span, over the whole run, the
        median engine batch, and the output tokens."""
        import pyarrow.parquet as pq
        import ray

        from cluster.run import run_sweep
        from cluster.spec import load_spec

        spec_path = self.out / f"{name}.yaml"
        actors = {"count": 1, "num_gpus": 1, **({} if depth == "auto" else {"shards_in_flight": int(depth)})}
        spec_path.write_text(json.dumps({
            "name": "bench-a", "output": str(self.out / name),
            "models": [{"name": "m", "path": self.model_path, "engine": {"backend": "vllm", **self.engine_overrides}}],
            "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "{text}",
                       "sampling": {"max_tokens": 256, "temperature": 1.0, "seed": 5, "stop": [".", "\n"]}}],
            "shards": {"max_samples": self.shard_size}, "actors": actors}))
        spec = load_spec(spec_path)
        started = time.perf_counter()
        ray.init(address="local", num_cpus=4, include_dashboard=False)
        try:
            report = run_sweep(spec, log=lambda line: None)
        finally:
            ray.shutdown()
        whole = time.perf_counter() - started
        assert not report.failed, report.failed
        shards = pq.read_table(self.out / name / "telemetry" / "shards.parquet").to_pandas()
        span = (shards["finished_at"].max() - shards["started_at"].min()).total_seconds()
        tokens = int(shards["output_tokens"].sum())
        return tokens / span, tokens / whole, shards["engine_batch_mean"].median(), tokens

    def _raw_rate(self) -> tuple[float, float, list[int]]:
        """One raw `LLM.generate` over (a)'s prompts on a fresh, warmed engine: tok/s, the mean batch
        per step, and the sorted output lengths."""
        from vllm import SamplingParams

        from cluster.planner import sample_seed

        llm = self.llm()
        prompts = self.token_prompts(llm, self.prompts)
        params = [SamplingParams(max_tokens=256, temperature=1.0, stop=[".", "\n"],
                                 seed=sample_seed(5, "t", f"p{i:05d}")) for i in range(self.n)]
        self.timed_generate(llm, prompts[:32], params[:32])  # warm-up, as raysweep's engine is warm too
        engine, held = llm.llm_engine, []
        cap, step = int(engine.vllm_config.scheduler_config.max_num_seqs), engine.step

        def counting_step():
            held.append(min(engine.get_num_unfinished_requests(), cap))
            return step()

        engine.step = counting_step  # LLM.generate steps through this attribute
        wall, tokens, outs = self.timed_generate(llm, prompts, params)
        self.free(llm)
        return tokens / wall, sum(held) / len(held), sorted(len(o.outputs[0].token_ids) for o in outs)

    def part_b(self) -> None:
        """CUDA graphs vs eager: one request decoding, and 256 prompts at once (fixed lengths)."""
        from vllm import SamplingParams

        single = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
        batch = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        rates = {}
        for mode, eager in (("graphs", False), ("eager", True)):
            llm = self.llm(enforce_eager=eager)
            prompts = self.token_prompts(llm, prompts_of(256, 32, 256, seed=2))
            self.timed_generate(llm, prompts[:8], batch)  # warm-up
            wall, tokens, _ = self.timed_generate(llm, prompts[:1], single)
            rates[(mode, "single")] = tokens / wall
            wall, tokens, _ = self.timed_generate(llm, prompts, batch)
            rates[(mode, "batch256")] = tokens / wall
            self.free(llm)
            for kind in ("single", "batch256"):
                self.record("b", f"{mode}_{kind}_tok_per_s", rates[(mode, kind)], "tok/s")
        for kind in ("single", "batch256"):
            self.record("b", f"RATIO graphs/eager {kind}", rates[("graphs", kind)] / rates[("eager", kind)], "x")

    def part_c(self) -> None:
        """A long shard with chunked prefill (chunk 2,048) vs without (one prompt per step budget)."""
        from vllm import SamplingParams

        from actors.engine import EngineProfile
        from actors.telemetry import GpuSampler

        texts = prompts_of(32, 12_000, 16_000, seed=3)
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        results = {}
        for mode, profile in (("chunked", EngineProfile("long", True, 2048)), ("unchunked", EngineProfile())):
            llm = self.llm(profile=profile, engine={"max_model_len": 16_384})
            prompts = self.token_prompts(llm, texts)
            blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
            self.timed_generate(llm, prompts[:2], params)  # warm-up
            with GpuSampler(interval_s=0.1) as gpu:
                wall, out_tokens, outs = self.timed_generate(llm, prompts, params)
            in_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
            results[mode] = (in_tokens + out_tokens) / wall
            self.free(llm)
            self.record("c", f"{mode}_total_tok_per_s", results[mode], "tok/s (prompt + output)")
            self.record("c", f"{mode}_peak_gpu_mem_mib", gpu.aggregates()["gpu_mem_used_max_mib"], "MiB (NVML)")
            self.record("c", f"{mode}_kv_cache_blocks", blocks, "blocks")
        self.record("c", "RATIO chunked/unchunked throughput", results["chunked"] / results["unchunked"], "x")

    def part_d(self) -> None:
        """Guided (JSON schema through xgrammar) vs free generation, same engine and prompts. Guided
        outputs are short JSON objects; free text runs to a newline, so its outputs are longer and its
        prefill is spread over more output tokens. The ratio is therefore taken at equal work: free
        generation again with each request's max_tokens = its guided output's length (ignore_eos), so
        both runs compute the same prompts and the same number of output tokens per request."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        from cluster.spec import StructuredSpec
        from cluster.structured import is_valid

        llm = self.llm()
        prompts = self.token_prompts(llm, self.prompts)
        natural = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, stop=["\n"]) for i in range(self.n)]
        guided = [SamplingParams(max_tokens=96, temperature=1.0, seed=i,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(self.n)]
        self.timed_generate(llm, prompts[:32], guided[:32])  # warm-up, grammar compiled
        wall_n, tok_n, _ = self.timed_generate(llm, prompts, natural)
        wall_g, tok_g, outs = self.timed_generate(llm, prompts, guided)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        same = [SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
        wall_f, tok_f, _ = self.timed_generate(llm, prompts, same)
        valid = sum(is_valid(StructuredSpec("json_schema", SCHEMA), o.outputs[0].text) for o in outs)
        self.free(llm)
        self.record("d", "free_to_newline_tok_per_s", tok_n / wall_n, f"tok/s ({tok_n / self.n:.0f} tok per output)")
        self.record("d", "free_same_lengths_tok_per_s", tok_f / wall_f, f"tok/s ({tok_f / self.n:.0f} tok per output)")
        self.record("d", "guided_tok_per_s", tok_g / wall_g, f"tok/s ({tok_g / self.n:.0f} tok per output)")
        self.record("d", "guided_valid", valid / self.n, "fraction")
        self.record("d", "ratio guided/free-to-newline", (tok_g / wall_g) / (tok_n / wall_n), "x (unequal work)")
        self.record("d", "RATIO guided/free", (tok_g / wall_g) / (tok_f / wall_f), "x (same prompts, same output lengths)")

    def part_e(self) -> None:
        """Whole-process timing against a plain vLLM script and Ray Data LLM (jobs/bench_e2e.py)."""
        from jobs.bench_e2e import EndToEnd

        EndToEnd(self, self.e2e).run()

    def part_x(self) -> None:
        """Where (a)'s gap comes from, on one warm engine in this process: the raw `LLM.generate` and
        raysweep's engine thread share the same `LLM` (the thread is idle while the raw calls run)."""
        probe = EngineProbe(self.model_path, self.engine_overrides)
        for metric, value in probe.rates(self.prompts, self.shard_size, raw=True).items():
            self.record("x", metric, value, "tok/s")
        probe.close()

    def part_y(self) -> None:
        """(a)'s gap, continued: the same engine thread inside a Ray actor with raysweep's resources
        (1 CPU, 1 GPU: Ray sets OMP_NUM_THREADS=1), then with OMP_NUM_THREADS raised."""
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False)
        try:
            probe_cls = ray.remote(EngineProbe)
            for label, env in (("ray_actor", None), ("ray_actor_omp", {"OMP_NUM_THREADS": str(os.cpu_count())})):
                actor = probe_cls.options(num_cpus=1, num_gpus=1, runtime_env=env and {"env_vars": env}).remote(
                    self.model_path, self.engine_overrides)
                rates = ray.get(actor.rates.remote(self.prompts, self.shard_size, False))
                ray.get(actor.close.remote())
                ray.kill(actor)
                for metric, value in rates.items():
                    self.record("y", f"{label}_{metric}", value, "tok/s")
        finally:
            ray.shutdown()

    def part_p(self) -> None:
        """Planning N prompts: the driver's preflight, with a cold and then a warm token cache. Each size
        is planned in a fresh process, so its peak memory is its own (flat memory: the same peak for
        every size)."""
        import tempfile
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        for n in self.planning_sizes:
            rng = random.Random(4)
            data = self.out / f"p_{n}.jsonl"
            with open(data, "w") as f:
                for i in range(n):
                    size = rng.randint(1000, 2000) if rng.random() < 0.1 else rng.randint(20, 120)
                    f.write(json.dumps({"id": i, "q": "".join(rng.choices("abcdefghij klmnop", k=size))}) + "\n")
            spec_path = self.out / f"p_{n}.yaml"
            spec_path.write_text(json.dumps({
                "name": "bench-p", "output": str(self.out / "p_results"),
                "models": [{"name": "m", "path": "builtin:tiny"}],
                "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "Q: {q}\nA:",
                           "sampling": {"max_tokens": 64}}]}))
            cache = tempfile.mkdtemp(prefix="bench-p-cache-")  # a cold token cache
            with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
                runs = pool.submit(_plan_twice, str(spec_path), cache).result()
            for run, (wall, shards, long, peak) in runs.items():
                self.record("p", f"{n}_{run}_plan_s", wall, f"s ({shards} shards, {long} long)")
                self.record("p", f"{n}_{run}_driver_peak_rss_mib", peak, "MiB (peak so far, in a fresh process)")
            data.unlink()

    def part_o(self) -> None:
        """Orchestration alone: the fake engine behind the real actors, scheduler and sink."""
        import ray

        from cluster.run import execute, prepare
        from cluster.spec import load_spec

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for n in self.orchestration_sizes:
                data = self.out / f"o_{n}.jsonl"
                with open(data, "w") as f:
                    f.writelines(json.dumps({"q": f"item {i} of the synthetic set", "a": "fake"}) + "\n"
                                 for i in range(n))
                spec_path = self.out / f"o_{n}.yaml"
                spec_path.write_text(json.dumps({
                    "name": f"bench-o-{n}", "output": str(self.out / f"o_{n}_results"),
                    "models": [{"name": "m", "path": "builtin:tiny", "engine": "fake"}],
                    "tasks": [{"name": "t", "data": str(data), "prompt": "{q}", "target": "a",
                               "scorer": "exact_match", "sampling": {"max_tokens": 1}}],
                    "actors": {"count": 2, "num_cpus": 1}}))
                started = time.perf_counter()
                prepared = prepare(load_spec(spec_path), new_run=True)
                planned = time.perf_counter()
                before = _status_mib("VmRSS")
                _reset_peak_rss()
                report = execute(prepared, log=lambda line: None)
                finished = time.perf_counter()
                during = _status_mib("VmHWM")
                assert report.samples == n and not report.failed
                self.record("o", f"{n}_plan_s", planned - started, "s (read, render, tokenize, shard)")
                self.record("o", f"{n}_orchestration_samples_per_s", n / (finished - planned),
                            "samples/s (scheduler + Ray + scoring + Parquet commits)")
                self.record("o", f"{n}_end_to_end_samples_per_s", n / (finished - started), "samples/s")
                self.record("o", f"{n}_driver_peak_rss_mib", _peak_rss_mib(), "MiB (peak so far, planning included)")
                self.record("o", f"{n}_orchestration_rss_growth_mib", during - before,
                            "MiB (driver peak during orchestration minus RSS before it)")
        finally:
            ray.shutdown()

    def save(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.out / "bench.parquet"
        schema = pa.schema([("part", pa.string()), ("metric", pa.string()), ("value", pa.float64()),
                            ("unit", pa.string())])
        table = pa.Table.from_pylist(self.rows, schema=schema)
        if path.exists():  # an earlier run's rows (one whose values were all null typed them null)
            table = pa.concat_tables([pq.read_table(path).cast(schema), table])
        pq.write_table(table, path)
        print("\n| part | metric | value | unit |\n|---|---|---:|---|")
        for r in self.rows:
            value = "" if r["value"] is None else f"{r['value']:.3f}" if abs(r["value"]) < 100 else f"{r['value']:.0f}"
            print(f"| {r['part']} | {r['metric']} | {value} | {r['unit']} |")


def _plan_twice(spec_path: str, cache: str) -> dict:
    """Part p's measurement, in a fresh process: preflight cold, then warm; wall s, shards, long shards
    and the process's peak RSS after each."""
    os.environ["RAYSWEEP_CACHE"] = cache
    from cluster.builtin_model import resolve_model_path
    from cluster.run import preflight
    from cluster.spec import load_spec

    resolve_model_path("builtin:tiny")  # built before timing, as a sweep's model would be there already
    spec, out = load_spec(spec_path), {}
    for run in ("cold", "warm"):
        started = time.perf_counter()
        plans = preflight(spec)
        wall = time.perf_counter() - started
        shards = plans[0].tasks[0].shards
        out[run] = (wall, len(shards), sum(s.profile == "long" for s in shards), _peak_rss_mib())
        del plans, shards
    return out


class EngineProbe:
    """Parts x and y: raysweep's VllmEngine over (a)'s prompts, seeds and sampling, timed in one batch and
    in shards (two in flight, as an actor runs them); `raw` adds `LLM.generate` on the same engine.
    Orders: `bench` (as generated) and `sorted` (the planner's: ascending prompt length)."""

    def __init__(self, model_path: str, overrides: dict):
        from actors.engine import EngineProfile
        from actors.vllm_engine import VllmEngine
        from cluster.spec import ModelSpec

        self.engine = VllmEngine(ModelSpec("bench", model_path, engine=dict(overrides)), model_path,
                                 EngineProfile(), 1.0)

    def rates(self, texts: list[str], shard_size: int, raw: bool) -> dict:
        from concurrent.futures import ThreadPoolExecutor

        from vllm import SamplingParams

        from actors.engine import GenRequest
        from cluster.planner import sample_seed
        from cluster.spec import SamplingSpec

        engine, n = self.engine, len(texts)
        ids = [engine.tokenizer(t)["input_ids"] for t in texts]
        seeds = [sample_seed(5, "t", f"p{i:05d}") for i in range(n)]
        orders = {"bench": list(range(n)), "sorted": sorted(range(n), key=lambda i: (len(ids[i]), i))}
        sampling = SamplingSpec(max_tokens=256, temperature=1.0, seed=5, stop=(".", "\n"))

        def generate(order) -> float:
            params = [SamplingParams(max_tokens=256, temperature=1.0, stop=[".", "\n"], seed=seeds[i]) for i in order]
            wall, tokens, _ = Bench.timed_generate(engine.llm, [{"prompt_token_ids": ids[i]} for i in order], params)
            return tokens / wall

        def threaded(order, size) -> float:
            requests = [GenRequest(f"p{i:05d}", ids[i], seeds[i]) for i in order]
            shards = [requests[k:k + size] for k in range(0, len(requests), size)]
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=2) as pool:  # the actor's depth: two shards in flight
                results = list(pool.map(lambda s: engine.generate(s, sampling, None), shards))
            return sum(r.output_tokens for rs in results for r in rs) / (time.perf_counter() - started)

        threaded(orders["bench"][:32], 32)  # warm-up
        out = {}
        if raw:
            for name, order in orders.items():
                out[f"raw_{name}_tok_per_s"] = generate(order)
            out["engine_bench_one_batch_tok_per_s"] = threaded(orders["bench"], n)
        out["engine_sorted_one_batch_tok_per_s"] = threaded(orders["sorted"], n)
        out[f"engine_sorted_shards_of_{shard_size}_tok_per_s"] = threaded(orders["sorted"], shard_size)
        return out

    def close(self) -> None:
        self.engine.close()


def _status_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM to the current RSS


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    from jobs.bench_e2e import add_arguments as add_e2e_arguments, config_from_args as e2e_config

    parser = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small", help="model path or builtin:NAME")
    parser.add_argument("--parts", default="a,b,c,d", help="which parts to run, comma-separated")
    parser.add_argument("--prompts", type=int, default=2048, help="prompts in parts a and d")
    parser.add_argument("--shard-size", type=int, default=256, help="part a: samples per shard")
    parser.add_argument("--in-flight", default="auto", help="part a: shards in flight per actor, comma-separated "
                                                             "settings (auto: raysweep's rule), one sweep each")
    parser.add_argument("--repeats", type=int, default=1, help="part a: runs of every sweep and the raw call")
    parser.add_argument("--engine", default="{}", help="parts a-d: vLLM arguments (JSON) on top of raysweep's, "
                                                       "e.g. '{\"async_scheduling\": false}'")
    parser.add_argument("--out", default="bench/out", help="folder for bench.parquet and scratch files")
    parser.add_argument("--samples", default="50000,200000", help="part o: sample counts, comma-separated")
    parser.add_argument("--plan-prompts", default="1000000", help="part p: prompts to plan, comma-separated sizes")
    add_e2e_arguments(parser)
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",")]

    import torch

    from cluster.builtin_model import resolve_model_path

    if set(parts) - {"o", "p"} and not torch.cuda.is_available():
        print("jobs.bench parts a-d need a CUDA GPU and vLLM (parts o and p run anywhere)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(resolve_model_path(args.model) if set(parts) - {"o", "p"} else args.model, out, args.prompts)
    bench.orchestration_sizes = [int(n) for n in args.samples.split(",")]
    bench.planning_sizes = [int(n) for n in args.plan_prompts.split(",")]
    bench.shard_size = args.shard_size
    bench.in_flight = [d.strip() for d in args.in_flight.split(",")]
    bench.repeats = args.repeats
    bench.engine_overrides = json.loads(args.engine)
    bench.e2e = e2e_config(args)
    bench.record("-", "device", None, torch.cuda.get_device_name() if torch.cuda.is_available()
                 else f"CPU only, {os.cpu_count()} cores")
    bench.record("-", "model", None, "builtin:tiny (fake engine in part o)" if set(parts) <= {"o", "p"} else args.model)
    try:
        for part in parts:
            getattr(bench, f"part_{part}")()
    finally:
        bench.save()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's INFO lines would drown the table
    sys.exit(main())
