"""GPU benchmark: ratios measured in one run, on one GPU, one model and one prompt set.

    python -m benchmarks --model builtin:small --parts a,b,c,d --out bench/out

(a)-(d) raysweep ÷ raw `LLM.generate`, CUDA graphs ÷ eager, chunked ÷ unchunked prefill, guided ÷ free
    (benchmarks/engine_ratios.py says how each is measured).
(e) whole processes, start to exit: raysweep ÷ a plain vLLM script ÷ Ray Data LLM, and several models in
    one sweep ÷ the plain script once per model (benchmarks/whole_process.py; flags --e-*).
(x) diagnostic for (a), one engine: raw `generate` in the bench's order and in raysweep's (sorted by
    prompt length), then raysweep's VllmEngine (its engine thread, no Ray) in one batch and in shards.
(y) diagnostic for (a), continued: that engine thread inside a Ray actor (1 CPU, 1 GPU, as raysweep's).
    (x), (y): benchmarks/breakdown.py.
(p) planning alone, on CPU: N synthetic prompts of mixed lengths (90% 20-120 characters, 10% 1-2k)
    read, rendered, measured in tokens and cut into shards; cold, then again with the token cache warm.
(o) orchestration alone, on CPU: N synthetic samples through planning, the scheduler, Ray, scoring and
    Parquet commits with the fake engine (answers at once); samples/s and the driver's peak memory.
(m) many models, on CPU: `raysweep plan` of M models x 1 task as a whole process: time, first line, memory.
    (p), (o), (m): benchmarks/orchestration.py.
Each part appends rows (part, metric, value, unit) to OUT/bench.parquet and the run prints a markdown table.
Parts l, w and r are commands of their own: python -m benchmarks.loglik, .pool, .repro.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks import breakdown, engine_ratios, orchestration, whole_process
from benchmarks.common import Bench

PARTS = {**engine_ratios.PARTS, **whole_process.PARTS, **breakdown.PARTS, **orchestration.PARTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
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
    parser.add_argument("--plan-models", default="1000,10000", help="part m: models to plan, comma-separated sizes")
    whole_process.add_arguments(parser)
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",")]

    import torch

    from cluster.inputs.builtin_model import resolve_model_path

    if set(parts) - {"o", "p", "m"} and not torch.cuda.is_available():
        print("benchmarks parts a-d need a CUDA GPU and vLLM (parts o, p and m run anywhere)", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()  # absolute: the specs it writes name their data from their own folder
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(resolve_model_path(args.model) if set(parts) - {"o", "p", "m"} else args.model, out, args.prompts)
    bench.orchestration_sizes = [int(n) for n in args.samples.split(",")]
    bench.planning_sizes = [int(n) for n in args.plan_prompts.split(",")]
    bench.plan_models = sorted(int(n) for n in args.plan_models.split(","))
    bench.shard_size = args.shard_size
    bench.in_flight = [d.strip() for d in args.in_flight.split(",")]
    bench.repeats = args.repeats
    bench.engine_overrides = json.loads(args.engine)
    bench.e2e = whole_process.config_from_args(args)
    bench.record("-", "device", None, torch.cuda.get_device_name() if torch.cuda.is_available()
                 else f"CPU only, {os.cpu_count()} cores")
    bench.record("-", "model", None, "builtin:tiny (fake engine in part o)" if set(parts) <= {"o", "p", "m"} else args.model)
    try:
        for part in parts:
            if part not in PARTS:
                raise ValueError(f"no bench part {part!r}; parts: {', '.join(PARTS)}")
            PARTS[part](bench)
    finally:
        bench.save()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's INFO lines would drown the table
    sys.exit(main())
