"""Ray Data LLM over the same work: the second baseline that bench part (e) times as a whole process.

    python -m benchmarks.ray_data_llm --model PATH --prompts FILE.jsonl --engine-args JSON --max-tokens N

Ray Data's vLLM processor (`ray.data.llm.build_processor` with a `vLLMEngineProcessorConfig`, as in
Ray 2.60): `--concurrency` engine replicas (default one), one GPU each, the prompts as raw text. Its
chat-template, tokenize and detokenize stages are off, so vLLM tokenizes and detokenizes inside the engine, as in the plain script.
Greedy, no stop strings. Prints one JSON line with the counts on stdout and exits.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.plain_vllm import add_baseline_arguments

BATCH_SIZE = 64  # rows per engine call; with Ray's 8 concurrent batches, 512 requests can be queued


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def engine_kwargs(llm_args: dict) -> dict:
    """raysweep's `vllm.LLM(...)` arguments as the processor's `engine_kwargs`. The model goes in
    `model_source` instead. Ray builds the engine from `vllm.AsyncEngineArgs`, which converts a
    compilation-config mapping itself but, unlike `LLM`, not a structured-outputs one: that is built here."""
    kwargs = {k: v for k, v in llm_args.items() if k != "model"}
    structured = kwargs.get("structured_outputs_config")
    if isinstance(structured, dict):
        from vllm.config import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(**structured)
    return kwargs


def run(model: str, rows: list[dict], llm_args: dict, max_tokens: int, batch_size: int,
        concurrency: int = 1) -> list[dict]:
    """Every row through the processor: one {"id", "output_tokens"} per row, in no set order."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=model, engine_kwargs=engine_kwargs(llm_args), concurrency=concurrency, batch_size=batch_size,
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}
    processor = build_processor(
        config,
        preprocess=lambda row: {"prompt": row["text"], "sampling_params": dict(sampling)},
        postprocess=lambda row: {"id": row["id"], "output_tokens": row["num_generated_tokens"]})
    return processor(ray.data.from_items(rows)).take_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_data_llm", description=__doc__.splitlines()[0])
    add_baseline_arguments(parser, "; `model` is ignored")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="rows per engine call")
    parser.add_argument("--concurrency", type=int, default=1, help="engine replicas, one GPU each")
    args = parser.parse_args(argv)
    rows = read_rows(args.prompts)
    try:
        import ray
        import ray.data.llm  # noqa: F401
    except ImportError as e:
        print(f"benchmarks.ray_data_llm: needs Ray Data LLM: pip install 'ray[data,llm]' ({e})", file=sys.stderr)
        return 2

    # a new local Ray, as `python -m jobs.sweep` starts one, not whatever /tmp/ray records
    ray.init(address="local")
    try:
        out = run(args.model, rows, json.loads(args.engine_args), args.max_tokens, args.batch_size, args.concurrency)
    finally:
        ray.shutdown()
    print(json.dumps({"outputs": len(out), "output_tokens": sum(int(r["output_tokens"]) for r in out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
