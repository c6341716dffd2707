"""Bench part (r): do raysweep's outputs repeat, and equal a plain vLLM script's? Whole processes, one run.

    python -m benchmarks.repro --model builtin:small --prompts 1312 --max-tokens 128 --out DIR [--steps identity,repro]

identity: the plain script (`benchmarks.plain_vllm --outputs`) twice with raysweep's vLLM arguments and once with
  vLLM's own defaults; raysweep once (`reproducible: false`, one engine on the GPU). Printed: how many
  greedy outputs of the second plain run, of the defaults run and of raysweep equal the first plain run's.
repro: raysweep with `reproducible: true` three ways: one actor in shards of 256; two actors sharing the GPU
  in shards of 64; one actor in shards of 64 killed (the driver's process group) once about half its shards
  were committed, then resumed. Printed: outputs identical between them, and the throughput (output tokens
  over first to last result, and over the whole process) of the first against raysweep's `identity` run,
  which differs only in `reproducible`.
cost: raysweep (one actor, shards of 256) without and with `reproducible: true`, each twice, alternating
  (the second of each on warm compile caches). Printed: output tokens per second over first to last result
  and the whole process's wall time of each, and their ratios per turn.
Every run's log is in DIR. Greedy decoding, synthetic prompts (`benchmarks.common.prompts_of`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import prompts_of, run_process, sweep_spec, vllm_args, write_prompts


def _cost(sweep, record) -> None:
    """Each mode twice, alternating: the second of each runs on warm compile caches. `sweep(label, reproducible)`:
    one sweep's speed figures."""
    runs = {}
    for turn in (1, 2):
        for reproducible in (False, True):
            label = f"cost_{'repro' if reproducible else 'plain'}_{turn}"
            runs[label] = sweep(label, reproducible)
            record(f"cost: {'reproducible' if reproducible else 'not reproducible'}, run {turn}", runs[label])
    for turn in (1, 2):
        plain_run, repro_run = runs[f"cost_plain_{turn}"], runs[f"cost_repro_{turn}"]
        record(f"RATIO cost run {turn}: reproducible/not output tok/s first to last result",
               repro_run["tok_per_s_span"] / plain_run["tok_per_s_span"])
        record(f"RATIO cost run {turn}: reproducible/not whole-process wall", repro_run["wall_s"] / plain_run["wall_s"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.repro", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--prompts", type=int, default=1312)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", default="identity,repro")
    parser.add_argument("--out", default="bench/out-r")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from cluster.inputs.builtin_model import resolve_model_path

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(args.model)
    data = write_prompts(out / "r_prompts.jsonl", prompts_of(args.prompts, 64, 1024, seed=13))
    ids = [json.loads(line)["id"] for line in open(data)]
    steps = set(args.steps.split(","))
    figures: dict = {}

    def record(name: str, value, unit: str = "") -> None:
        figures[name] = value
        print(f"[bench] r {name} = {value}{(' ' + unit) if unit else ''}", flush=True)

    def plain(label: str, engine_args: dict) -> dict:
        path = out / f"r_{label}.jsonl"
        run_process([sys.executable, "-m", "benchmarks.plain_vllm", "--model", model, "--prompts", str(data),
                     "--engine-args", json.dumps(engine_args), "--max-tokens", str(args.max_tokens),
                     "--outputs", str(path)], {}, out / f"r_{label}")
        return {row["id"]: row["text"] for row in map(json.loads, open(path))}

    def sweep(label: str, reproducible: bool, actors: dict, shard: int) -> tuple[dict, dict]:
        spec = _spec(out, label, model, data, args.max_tokens, reproducible, actors, shard)
        wall, _ = run_process([sys.executable, "-m", "jobs.sweep", str(spec), "--new-run"], {}, out / f"r_{label}")
        return _outputs(out / f"r_{label}_out"), dict(_speed(out / f"r_{label}_out"), wall_s=wall)

    def same(a: dict, b: dict) -> str:
        return f"{sum(a.get(i) == b.get(i) and a.get(i) is not None for i in ids)} of {len(ids)}"

    one = {"count": 1, "num_gpus": 1}
    if "identity" in steps:
        first = plain("plain1", vllm_args(model, {}))
        record("plain run 2 equals plain run 1", same(plain("plain2", vllm_args(model, {})), first))
        defaults = plain("plain_defaults", {})
        record("plain with vLLM's default arguments equals plain run 1", same(defaults, first))
        outputs, speed = sweep("raysweep", False, one, 256)
        record("raysweep (reproducible: false) equals plain run 1", same(outputs, first))
        record("raysweep (reproducible: false) equals plain with vLLM's default arguments", same(outputs, defaults))
        record("raysweep (reproducible: false) speed", speed)
    if "repro" in steps:
        base, speed = sweep("repro_one", True, one, 256)
        record("reproducible one actor, shards of 256: speed", speed)
        two, _ = sweep("repro_two", True, {"count": 2, "num_gpus": 0.5}, 64)
        record("reproducible two actors on the GPU, shards of 64, equals one actor", same(two, base))
        resumed = _killed_and_resumed(out, model, data, args.max_tokens)
        record("reproducible killed at about half and resumed, equals one actor", same(resumed, base))
        if "raysweep (reproducible: false) speed" in figures:
            plain_speed = figures["raysweep (reproducible: false) speed"]
            record("RATIO reproducible/not, output tok/s first to last result",
                   speed["tok_per_s_span"] / plain_speed["tok_per_s_span"])
            record("RATIO reproducible/not, whole-process wall", speed["wall_s"] / plain_speed["wall_s"])
    if "cost" in steps:
        _cost(lambda label, reproducible: sweep(label, reproducible, one, 256)[1], record)
    (out / "r_figures.json").write_text(json.dumps(figures, indent=1, default=str))
    return 0


def _spec(out: Path, label: str, model: str, data: Path, max_tokens: int, reproducible: bool, actors: dict,
          shard: int) -> Path:
    raw = sweep_spec(f"r-{label}", out / f"r_{label}_out", [("m", model)], [("t", data)], {}, max_tokens, actors)
    raw["reproducible"] = reproducible
    raw["shards"] = {"max_samples": shard}
    path = out / f"r_{label}.yaml"
    path.write_text(json.dumps(raw))
    return path


def _outputs(output: Path) -> dict:
    import pyarrow.parquet as pq

    table = pq.read_table(output / "results", columns=["sample_id", "output_text"]).to_pylist()
    return {r["sample_id"]: r["output_text"] for r in table}


def _speed(output: Path) -> dict:
    """Output tokens, and per second over first to last result (the manifest's clock)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tokens = pc.sum(pq.read_table(output / "results", columns=["output_tokens"])["output_tokens"]).as_py()
    run = json.loads((output / "manifest.json").read_text())["runs"][-1]
    span = run["last_result_s"] - run["first_result_s"]
    return {"output_tokens": tokens, "span_s": span, "tok_per_s_span": tokens / span if span > 0 else None}


def _killed_and_resumed(out: Path, model: str, data: Path, max_tokens: int) -> dict:
    """One actor in shards of 64, the driver's process group killed once about half the shards were
    committed, then the same command again."""
    spec = _spec(out, "repro_resumed", model, data, max_tokens, True, {"count": 1, "num_gpus": 1}, 64)
    output = out / "r_repro_resumed_out"
    argv = [sys.executable, "-m", "jobs.sweep", str(spec), "--new-run"]
    log = open(out / "r_repro_resumed_killed.stdout", "w")
    driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env=os.environ | {"PYTHONUNBUFFERED": "1"})
    from cluster.store.manifest import read_manifest

    total, done = None, 0
    while driver.poll() is None:
        try:  # the manifest with its journal: commits as they happen
            shards = read_manifest(str(output))["shards"]
            total = len(shards) or total
            done = sum(s.get("state") == "committed" for s in shards.values())
        except (OSError, ValueError, KeyError):
            pass
        if total and done >= total // 2:
            os.killpg(driver.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    driver.wait()
    print(f"[bench] r killed the driver with {done} of {total} shards committed", flush=True)
    _wait_for_free_gpu()
    run_process(argv[:-1], {}, out / "r_repro_resumed")  # the same command, without --new-run: a resume
    return _outputs(output)


def _wait_for_free_gpu(timeout_s: float = 90) -> None:
    """Until the killed run's processes have given the GPU's memory back (NVML: under 5% used)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    deadline = time.time() + timeout_s
    while True:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        if info.used < 0.05 * info.total or time.time() > deadline:
            print(f"[bench] r GPU memory used after the kill: {info.used / 2**30:.1f} GiB", flush=True)
            return
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
