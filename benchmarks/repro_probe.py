"""Which vLLM settings make greedy outputs batch-invariant? One engine per setting, each in a process of its own.

    python -m benchmarks.repro_probe --model builtin:small --prompts 1312 --max-tokens 64 --out DIR \
        --configs '[{"name": "eager", "env": {"VLLM_BATCH_INVARIANT": "1"}, "engine": {"enforce_eager": true}}]'

A setting's `engine` goes on top of raysweep's vLLM arguments for a short shard (`"base": "plain"`: on top
of vLLM's defaults instead).

Each setting's engine generates the same prompts four times, greedy, through `LLM.generate` (one call per
group, so a group is what the engine batches): in groups of 256 (the reference), in groups of 64, in groups
of 256 again, and in reverse order in groups of 100 (other neighbours, other batch sizes). Printed per
setting: how many outputs (token ids) of each pass equal the reference's, whether vLLM says its
batch-invariant mode is on inside the engine, and the reference pass's output tokens per second.
This isolates the engine from raysweep: a setting that is not invariant here cannot be in a sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PASSES = (("256", 256, False), ("64", 64, False), ("256 again", 256, False), ("reversed, 100", 100, True))


def one(model: str, prompts: list[str], max_tokens: int, engine: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model, tokenizer=model, seed=0, **engine)
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    order = list(range(len(prompts)))
    outputs, speed = {}, {}
    for name, group, reverse in PASSES:
        ids = order[::-1] if reverse else order
        got, tokens, began = {}, 0, time.perf_counter()
        for at in range(0, len(ids), group):
            chunk = ids[at:at + group]
            for i, out in zip(chunk, llm.generate([prompts[i] for i in chunk], params, use_tqdm=False)):
                got[i] = list(out.outputs[0].token_ids)
                tokens += len(got[i])
        speed[name] = round(tokens / (time.perf_counter() - began), 1)
        outputs[name] = got
    ref = outputs["256"]
    same = {name: sum(outputs[name][i] == ref[i] for i in order) for name, _, _ in PASSES[1:]}
    return {"start_s": round(start_s, 1), "equal_to_256": same, "of": len(order), "tok_per_s": speed,
            "invariant_in_driver": _invariant_flag()}


def _invariant_flag():
    try:
        from vllm.model_executor.layers import batch_invariant
    except ImportError:
        return None
    probe = getattr(batch_invariant, "vllm_is_batch_invariant", None)
    return probe() if callable(probe) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.repro_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--prompts", type=int, default=1312)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", required=True, help="JSON list of {name, env, engine}")
    parser.add_argument("--out", default="bench/out-probe")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: the JSON of one setting
    args = parser.parse_args(argv)
    from benchmarks.common import prompts_of

    prompts = prompts_of(args.prompts, 64, 1024, seed=13)
    if args.one:
        from cluster.inputs.builtin_model import resolve_model_path

        config = json.loads(args.one)
        model = resolve_model_path(args.model)
        engine = dict(config.get("engine", {}))
        if config.get("base", "raysweep") == "raysweep":  # raysweep's arguments for a short shard, the setting's on top
            from benchmarks.common import vllm_args

            engine = {k: v for k, v in vllm_args(model, engine).items() if k not in ("model", "tokenizer", "seed")}
        print("ENGINE " + json.dumps(engine, default=str), flush=True)
        print("PROBE " + json.dumps(one(model, prompts, args.max_tokens, engine)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for config in json.loads(args.configs):
        log = out / f"probe_{config['name']}.log"
        began = time.perf_counter()
        with open(log, "w") as f:
            code = subprocess.run([sys.executable, "-m", "benchmarks.repro_probe", "--model", args.model, "--prompts",
                                   str(args.prompts), "--max-tokens", str(args.max_tokens), "--configs", "[]",
                                   "--one", json.dumps(config)], stdout=f, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **config.get("env", {})}).returncode
        found = [line[6:] for line in log.read_text(errors="replace").splitlines() if line.startswith("PROBE ")]
        result = json.loads(found[-1]) if found else {"exit": code, "tail": log.read_text(errors="replace")[-800:]}
        print(f"[probe] {config['name']} ({time.perf_counter() - began:.0f} s): {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
