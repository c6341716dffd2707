"""A plain vLLM log-likelihood script: the baseline for raysweep's `type: loglikelihood` tasks.

    python -m benchmarks.plain_vllm_loglik MODEL_DIR DATA.jsonl [--out PATH] [--max-model-len N] [--enforce-eager]

What a user would write without raysweep, the way lm-evaluation-harness's vLLM backend scores multiple choice: each
JSONL row {"context": str, "choices": [str, ...], "label": int} gives one request per choice, whose prompt is the
token ids encode(context) + the choice's continuation ids (lm-eval's `_encode_pair`: the context's trailing spaces move
to the continuation, and the continuation is encode(context + choice)[len(encode(context)):]). One `generate` over every
request with SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, detokenize=False), as lm-eval's
`_model_generate` does; a choice scores the sum of its continuation tokens' prompt logprobs. acc: the argmax choice is
the label; acc_norm: the argmax of score / len(choice in UTF-8 bytes) is the label (lm-eval calls that one
`acc_bytes`; its own `acc_norm` divides by characters). One JSON line on stdout, {rows, requests, acc, acc_norm,
generate_s}; with --out, one JSONL row per data row with each choice's summed logprob, token count and is_greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` for causal models (lm_eval/api/model.py); an empty context is BOS (else EOS) alone."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], tokenizer.encode(continuation, add_special_tokens=False)
    whole, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plain_vllm_loglik", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model directory or hub id")
    parser.add_argument("data", help="JSONL file, one {\"context\": ..., \"choices\": [...], \"label\": i} row each")
    parser.add_argument("--out", help="also write each row's per-choice logprobs as JSONL here")
    parser.add_argument("--max-model-len", type=int, help="vllm.LLM(max_model_len=...)")
    parser.add_argument("--enforce-eager", action="store_true", help="vllm.LLM(enforce_eager=True): no CUDA graphs")
    args = parser.parse_args(argv)
    rows = read_rows(args.data)
    try:
        from vllm import LLM, SamplingParams, TokensPrompt
    except ImportError as e:
        print(f"benchmarks.plain_vllm_loglik: vLLM is not installed: pip install 'raysweep[vllm]' ({e})",
              file=sys.stderr)
        return 2

    engine_args = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(model=args.model, enforce_eager=args.enforce_eager, **engine_args)
    tokenizer = llm.get_tokenizer()
    pairs = [encode_pair(tokenizer, row["context"], choice) for row in rows for choice in row["choices"]]
    prompts = [TokensPrompt(prompt_token_ids=ctx + cont) for ctx, cont in pairs]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - started

    scored = []  # (summed logprob, is_greedy) per request, in prompt order
    for (ctx, cont), out in zip(pairs, outs):
        # prompt_logprobs[p] is {token_id: Logprob(logprob, rank, decoded_token)} for prompt position p (None at 0),
        # always holding the prompt's own token at p, plus the top-1 token
        steps = [out.prompt_logprobs[p] for p in range(len(ctx), len(ctx) + len(cont))]
        total = sum(step[tok].logprob for step, tok in zip(steps, cont))
        greedy = all(max(step, key=lambda t: step[t].logprob) == tok for step, tok in zip(steps, cont))
        scored.append((total, greedy))

    acc = acc_norm = 0
    at = 0
    out_file = open(args.out, "w") if args.out else None
    for i, row in enumerate(rows):
        choices, (lls, greedy) = row["choices"], zip(*scored[at:at + len(row["choices"])])
        at += len(choices)
        norm = [ll / max(1, len(c.encode("utf-8"))) for ll, c in zip(lls, choices)]
        acc += max(range(len(choices)), key=lambda j: lls[j]) == row["label"]
        acc_norm += max(range(len(choices)), key=lambda j: norm[j]) == row["label"]
        if out_file:
            n_tokens = [len(cont) for _, cont in pairs[at - len(choices):at]]
            out_file.write(json.dumps({"row": i, "label": row["label"], "logprobs": list(lls),
                                       "n_tokens": n_tokens, "is_greedy": list(greedy)}) + "\n")
    if out_file:
        out_file.close()
    n = max(1, len(rows))
    print(json.dumps({"rows": len(rows), "requests": len(prompts), "acc": acc / n, "acc_norm": acc_norm / n,
                      "generate_s": generate_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
