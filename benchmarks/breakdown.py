"""Bench parts (x) and (y): where part (a)'s gap between raysweep and raw vLLM comes from, step by step.

(x) one engine in this process: raw `generate` in the bench's order and in raysweep's (sorted by prompt
    length), then raysweep's VllmEngine (its engine thread, no Ray) in one batch and in shards.
(y) that engine thread inside a Ray actor (1 CPU, 1 GPU, as raysweep's), then with OMP_NUM_THREADS raised.
Run through `python -m benchmarks --parts x,y`.
"""

from __future__ import annotations

import os
import time

from benchmarks.common import Bench


def part_x(bench: Bench) -> None:
    """Where (a)'s gap comes from, on one warm engine in this process: the raw `LLM.generate` and
    raysweep's engine thread share the same `LLM` (the thread is idle while the raw calls run)."""
    probe = EngineProbe(bench.model_path, bench.engine_overrides)
    for metric, value in probe.rates(bench.prompts, bench.shard_size, raw=True).items():
        bench.record("x", metric, value, "tok/s")
    probe.close()


def part_y(bench: Bench) -> None:
    """(a)'s gap, continued: the same engine thread inside a Ray actor with raysweep's resources
    (1 CPU, 1 GPU: Ray sets OMP_NUM_THREADS=1), then with OMP_NUM_THREADS raised."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        probe_cls = ray.remote(EngineProbe)
        for label, env in (("ray_actor", None), ("ray_actor_omp", {"OMP_NUM_THREADS": str(os.cpu_count())})):
            actor = probe_cls.options(num_cpus=1, num_gpus=1, runtime_env=env and {"env_vars": env}).remote(
                bench.model_path, bench.engine_overrides)
            rates = ray.get(actor.rates.remote(bench.prompts, bench.shard_size, False))
            ray.get(actor.close.remote())
            ray.kill(actor)
            for metric, value in rates.items():
                bench.record("y", f"{label}_{metric}", value, "tok/s")
    finally:
        ray.shutdown()


class EngineProbe:
    """Parts x and y: raysweep's VllmEngine over (a)'s prompts, seeds and sampling, timed in one batch and
    in shards (two in flight, as an actor runs them); `raw` adds `LLM.generate` on the same engine.
    Orders: `bench` (as generated) and `sorted` (the planner's: ascending prompt length)."""

    def __init__(self, model_path: str, overrides: dict):
        from actors.engine import EngineProfile
        from actors.vllm_engine import VllmEngine
        from cluster.contracts.spec import ModelSpec

        self.engine = VllmEngine(ModelSpec("bench", model_path, engine=dict(overrides)), model_path,
                                 EngineProfile(), 1.0)

    def rates(self, texts: list[str], shard_size: int, raw: bool) -> dict:
        from concurrent.futures import ThreadPoolExecutor

        from vllm import SamplingParams

        from actors.engine import GenRequest
        from cluster.contracts.shard import sample_seed
        from cluster.contracts.spec import SamplingSpec

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


PARTS = {"x": part_x, "y": part_y}
