"""What a vLLM request that asks for prompt log-probabilities gives back, read as the log-likelihood path needs it:
the values of the prompt's last tokens that vLLM computed, and how many tokens it computed (docs/gpu.md,
Log-likelihood). No vLLM import: the output is read through its attributes."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine import GenRequest


@dataclass
class PromptTail:
    """What one prompt-log-probability request gave: (log-probability, rank) of the prompt's last tokens, as
    many as vLLM computed and returned (a suffix of the prompt), and how many prompt tokens it computed rather
    than read from the prefix cache."""
    scores: list[tuple[float, int]]
    computed: int


def prompt_tail(req: GenRequest, out, need: int) -> PromptTail:
    """The values of the prompt's last `need` tokens (a choice's), read back to front as far as
    `out.prompt_logprobs` holds them: fewer where the prefix cache covered some of them.

    vLLM puts None for the first position, then one entry per position it computed: with a prefix-cache hit
    of `num_cached_tokens`, the model runner vLLM 0.26 uses for Llama-shaped models (v1/worker/gpu/
    sample/prompt_logprob.py) returns entries for the positions after the hit only; the older runner
    (gpu_model_runner.py) returns one per position, those before the hit never written. So an entry is kept
    where it lies after the hit (the token at position p is predicted from position p-1, which must have been
    computed) and holds the prompt's own token there. With `prompt_logprobs=0` and `flat_logprobs`, the
    FlatLogprobs container holds one entry per position (token ids, logprobs, ranks: parallel lists), of which
    the last `need` are sliced; any other container ({token id: Logprob} per position, which always holds the
    prompt's own token) is read at those positions. Only the choice's tokens are looked at, not the context's."""
    ids, plp = req.prompt_token_ids, out.prompt_logprobs
    cached = int(getattr(out, "num_cached_tokens", None) or 0)
    n, have = len(ids), len(plp) - 1  # entries after the first position's None
    take = max(0, min(need, have))
    if getattr(plp, "start_indices", None) is not None and len(plp.token_ids) == have:
        tail = list(zip(plp.token_ids[have - take:], plp.logprobs[have - take:], plp.ranks[have - take:]))
    else:
        tail = []
        for p, i in zip(range(n - take, n), range(len(plp) - take, len(plp))):
            got = (plp[i] or {}).get(ids[p])
            tail.append((ids[p], got.logprob, got.rank) if got is not None else (None, 0.0, 0))
    scores: list[tuple[float, int]] = []
    for p, (token, logprob, rank) in zip(range(n - 1, -1, -1), reversed(tail)):
        if p <= cached or token != ids[p]:
            break
        scores.append((logprob, rank))
    scores.reverse()
    return PromptTail(scores, n - cached)
