"""Bench parts (p) and (o): raysweep's own cost with no model in the way, on CPU.

(p) planning alone: N synthetic prompts of mixed lengths (90% 20-120 characters, 10% 1-2k) read, rendered,
    measured in tokens and cut into shards; cold, then again with the token cache warm.
(o) orchestration alone: N synthetic samples through planning, the scheduler, Ray, scoring and Parquet
    commits with the fake engine (answers at once); samples/s and the driver's peak memory.
(m) many models: `raysweep plan` as a whole process over M models of one folder x the quickstart's
    arithmetic task (150 rows): its time to exit, to its first line on stderr, and its peak memory.
Run through `python -m benchmarks --parts p,o,m`.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from benchmarks.common import Bench


def part_p(bench: Bench) -> None:
    """Planning N prompts: the driver's preflight, with a cold and then a warm token cache. Each size
    is planned in a fresh process, so its peak memory is its own (flat memory: the same peak for
    every size)."""
    import tempfile
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    for n in bench.planning_sizes:
        rng = random.Random(4)
        data = bench.out / f"p_{n}.jsonl"
        with open(data, "w") as f:
            for i in range(n):
                size = rng.randint(1000, 2000) if rng.random() < 0.1 else rng.randint(20, 120)
                f.write(json.dumps({"id": i, "q": "".join(rng.choices("abcdefghij klmnop", k=size))}) + "\n")
        spec_path = bench.out / f"p_{n}.yaml"
        spec_path.write_text(json.dumps({
            "name": "bench-p", "output": str(bench.out / "p_results"),
            "models": [{"name": "m", "path": "builtin:tiny"}],
            "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "Q: {q}\nA:",
                       "sampling": {"max_tokens": 64}}]}))
        cache = tempfile.mkdtemp(prefix="bench-p-cache-")  # a cold token cache
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            runs = pool.submit(_plan_twice, str(spec_path), cache).result()
        for run, (wall, shards, long, peak) in runs.items():
            bench.record("p", f"{n}_{run}_plan_s", wall, f"s ({shards} shards, {long} long)")
            bench.record("p", f"{n}_{run}_driver_peak_rss_mib", peak, "MiB (peak so far, in a fresh process)")
        data.unlink()


def part_o(bench: Bench) -> None:
    """Orchestration alone: the fake engine behind the real actors, scheduler and sink."""
    import ray

    from cluster.inputs.checks import check_inputs
    from cluster.schedule.run import execute, prepare
    from cluster.inputs.spec_file import load_spec

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for n in bench.orchestration_sizes:
            data = bench.out / f"o_{n}.jsonl"
            with open(data, "w") as f:
                f.writelines(json.dumps({"q": f"item {i} of the synthetic set", "a": "fake"}) + "\n"
                             for i in range(n))
            spec_path = bench.out / f"o_{n}.yaml"
            spec_path.write_text(json.dumps({
                "name": f"bench-o-{n}", "output": str(bench.out / f"o_{n}_results"),
                "models": [{"name": "m", "path": "builtin:tiny", "engine": "fake"}],
                "tasks": [{"name": "t", "data": str(data), "prompt": "{q}", "target": "a",
                           "scorer": "exact_match", "sampling": {"max_tokens": 1}}],
                "actors": {"count": 2, "num_cpus": 1}}))
            started = time.perf_counter()
            spec = load_spec(spec_path)
            prepared = prepare(spec, check_inputs(spec).data, new_run=True)
            planned = time.perf_counter()
            before = _status_mib("VmRSS")
            _reset_peak_rss()
            report = execute(prepared, log=lambda line: None)
            finished = time.perf_counter()
            during = _status_mib("VmHWM")
            assert report.samples == n and not report.failed
            bench.record("o", f"{n}_plan_s", planned - started, "s (read, render, tokenize, shard)")
            bench.record("o", f"{n}_orchestration_samples_per_s", n / (finished - planned),
                         "samples/s (scheduler + Ray + scoring + Parquet commits)")
            bench.record("o", f"{n}_end_to_end_samples_per_s", n / (finished - started), "samples/s")
            bench.record("o", f"{n}_driver_peak_rss_mib", _peak_rss_mib(), "MiB (peak so far, planning included)")
            bench.record("o", f"{n}_orchestration_rss_growth_mib", during - before,
                         "MiB (driver peak during orchestration minus RSS before it)")
    finally:
        ray.shutdown()


def _plan_twice(spec_path: str, cache: str) -> dict:
    """Part p's measurement, in a fresh process: preflight cold, then warm; wall s, shards, long shards
    and the process's peak RSS after each."""
    os.environ["RAYSWEEP_CACHE"] = cache
    from cluster.inputs.builtin_model import resolve_model_path
    from cluster.plan.plan_source import preflight
    from cluster.inputs.spec_file import load_spec

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


def part_m(bench: Bench) -> None:
    """`raysweep plan` of M models x 1 task, each size a process of its own, in increasing order (so the
    children's peak RSS that getrusage reports is this size's)."""
    import resource
    import subprocess
    import sys

    data = Path(__file__).resolve().parents[1] / "sweeps" / "data" / "arithmetic.jsonl"
    for m in bench.plan_models:
        spec_path = bench.out / f"m_{m}.yaml"
        spec_path.write_text(json.dumps({
            "name": "bench-m", "output": str(bench.out / "m_results"),
            "models": [{"name": f"m{i}", "path": "builtin:tiny"} for i in range(m)],
            "tasks": [{"name": "arithmetic", "data": str(data), "id_column": "id",
                       "prompt": "Question: {question}\nAnswer:", "target": "answer",
                       "sampling": {"max_tokens": 8}, "scorer": "numeric_match"}]}))
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "plan", str(spec_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = proc.stderr.readline()
        said = time.perf_counter() - started if first else None
        rest = proc.stderr.read()
        if proc.wait() != 0:
            raise RuntimeError(f"raysweep plan of {m} models failed: {(first + rest)[-2000:]}")
        bench.record("m", f"{m}_models_plan_s", time.perf_counter() - started, "s (the whole command)")
        bench.record("m", f"{m}_models_first_line_s", said, "s (none: it ended before its first progress line)")
        bench.record("m", f"{m}_models_peak_rss_mib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                     "MiB")


PARTS = {"p": part_p, "o": part_o, "m": part_m}
