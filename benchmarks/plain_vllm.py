"""A plain vLLM script: the baseline that bench part (e) times as a whole process.

    python -m benchmarks.plain_vllm --model PATH --prompts FILE.jsonl --engine-args JSON --max-tokens N

What a user would write without raysweep: one `vllm.LLM`, one `generate` over every prompt (greedy, no
stop strings), one JSON line on stdout with the counts and its own phase times, exit. The prompts are the `text` field of each
JSONL row; the engine arguments are given whole (the bench passes raysweep's own, so both engines match).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def read_texts(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def read_ids(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["id"] for line in f if line.strip()]


def add_baseline_arguments(parser: argparse.ArgumentParser, engine_note: str = "") -> None:
    """What every baseline script of bench part (e) takes: the model, the prompts, vLLM's arguments."""
    parser.add_argument("--model", required=True, help="model directory or hub id")
    parser.add_argument("--prompts", required=True, help="JSONL file, one {\"id\": ..., \"text\": ...} row per prompt")
    parser.add_argument("--engine-args", default="{}", help=f"vllm.LLM(...) arguments (JSON){engine_note}")
    parser.add_argument("--max-tokens", type=int, default=256, help="generated tokens at most, per prompt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plain_vllm", description=__doc__.splitlines()[0])
    add_baseline_arguments(parser)
    parser.add_argument("--outputs", help="also write each output as a JSONL row {id, text} here (bench part r)")
    args = parser.parse_args(argv)
    texts = read_texts(args.prompts)
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        print(f"benchmarks.plain_vllm: vLLM is not installed: pip install 'raysweep[vllm]' ({e})", file=sys.stderr)
        return 2

    imported = time.perf_counter()
    llm = LLM(**{**json.loads(args.engine_args), "model": args.model})
    built = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
    done = time.perf_counter()
    if args.outputs:
        with open(args.outputs, "w") as f:
            for sample_id, out in zip(read_ids(args.prompts), outs):
                f.write(json.dumps({"id": sample_id, "text": out.outputs[0].text}) + "\n")
    # its own clock beside the bench's whole-process one: import, engine construction, generate
    print(json.dumps({"outputs": len(outs), "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      "import_s": imported - started, "init_s": built - imported, "generate_s": done - built}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
