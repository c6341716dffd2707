"""Multiple choice by log-likelihood, as lm-evaluation-harness does it (`type: loglikelihood` tasks).

1. Each row's choices come from a column (a list per row) or from the task (one list for every row); its
   target is the right choice's index or its text.
2. Context and choice are tokenized as lm-eval's `_encode_pair`: whitespace at the end of the context moves
   to the front of the choice, the context is encoded alone, the pair encoded whole, and the choice's tokens
   are the whole's tokens past the context's length; the engine is given context tokens + those tokens.
   A context that is "" (before the split) is, as lm-eval has it, the tokenizer's BOS token (else EOS),
   and each choice its own tokens. A context or a choice that is still 0 tokens is refused in planning.
3. An engine returns, per choice, the summed log-probability of its tokens given what precedes them and
   whether each token was the most likely one (lm-eval's `is_greedy`).
4. acc: the choice with the highest sum is the target; acc_norm: the highest sum per character of the
   choice (lm-eval's acc_norm), acc_bytes per UTF-8 byte (lm-eval's acc_bytes). Ties go to the first
   choice (numpy's argmax, as lm-eval).
5. What is scored after the prompt is the task's target_delimiter (default " ", lm-eval's) then the choice
   (`continuations`); lengths for acc_norm and acc_bytes are the choice's alone, as lm-eval measures them.
The driver plans with `pair_lengths` and the actor builds its requests with `encode_pairs`: one function
for both, so the length the driver measured is the length the engine runs.
"""

from __future__ import annotations

from typing import Any, Sequence

from cluster.contracts.task_spec import TaskSpec


def row_choices(task: TaskSpec, row: dict) -> Any:
    """The row's choices as read (a column's value, or the task's list): checked by `choices_problem`."""
    return list(task.choices) if isinstance(task.choices, tuple) else row.get(task.choices)


def choices_problem(choices: Any) -> str | None:
    """Why a row's choices cannot be scored, or None."""
    if not isinstance(choices, list) or not choices:
        return f"must be a non-empty list of choice texts, got {'an empty list' if choices == [] else repr(choices)[:60]}"
    bad = next((i for i, c in enumerate(choices) if not isinstance(c, str) or not c), None)
    if bad is not None:
        return f"choice {bad} must be a non-empty string, got {choices[bad]!r}"
    return None


def target_index(target: Any, choices: Sequence[str]) -> int:
    """The right choice's index from a target that is an index (an integer, or its digits as text) or one of
    the choices' texts; ValueError saying why otherwise."""
    if isinstance(target, str) and target in choices:
        return list(choices).index(target)
    index = int(target) if isinstance(target, str) and target.strip().isdigit() else target
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"target {target!r} is neither a choice's index nor one of the choices {list(choices)!r}")
    if not 0 <= index < len(choices):
        raise ValueError(f"target index {index} is out of range for {len(choices)} choices")
    return index


def split_pair(context: str, choice: str) -> tuple[str, str]:
    """lm-eval's rule: trailing whitespace of the context belongs to the choice."""
    spaces = len(context) - len(context.rstrip())
    return (context[:-spaces], context[-spaces:] + choice) if spaces else (context, choice)


def encode_pairs(contexts: Sequence[str], choices: Sequence[Sequence[str]], tokenizer,
                 add_special_tokens: bool) -> list[tuple[list[int], list[list[int]]]]:
    """Per row: the context's token ids and each choice's continuation ids (step 2 above); the context
    (less its trailing whitespace) is the same for each of a row's choices, so it is encoded once."""
    from cluster.contracts.tokens import tokenize

    pairs = [[split_pair(ctx, choice) for choice in row] for ctx, row in zip(contexts, choices)]
    wholes = iter(tokenize([c + x for row in pairs for c, x in row], tokenizer, add_special_tokens))
    ctx_ids = tokenize([row[0][0] if row else "" for row in pairs], tokenizer, add_special_tokens)
    encoded = [(list(ids), [list(next(wholes)[len(ids):]) for _ in row]) for ids, row in zip(ctx_ids, pairs)]
    empty = [k for k, ctx in enumerate(contexts) if ctx == ""]
    if empty:
        alone = iter(tokenize([c for k in empty for c in choices[k]], tokenizer, False))
        for k in empty:
            encoded[k] = _prefixed([list(next(alone)) for _ in choices[k]], prefix_token(tokenizer))
    return encoded


def prefix_token(tokenizer) -> int | None:
    """The token an empty context is replaced with, as lm-eval's `prefix_token_id`: BOS, else EOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None else getattr(tokenizer, "eos_token_id", None)


def _prefixed(alone: list[list[int]], prefix: int | None) -> tuple[list[int], list[list[int]]]:
    """A row whose context is "" (step 2's exception, lm-eval's `loglikelihood` at v0.4.13): the context is
    the prefix token and each choice is its own tokens (no special tokens, no split); a choice that already
    starts with the prefix token gives it as the context. No prefix token: an empty context (refused)."""
    if prefix is None:
        return [], alone
    return [prefix], [ids[1:] if ids[:1] == [prefix] else ids for ids in alone]


def pair_lengths(encoded: Sequence[tuple[list[int], list[list[int]]]]) -> list[int]:
    """The longest sequence (context + choice) the engine runs for each row."""
    return [len(ctx) + max((len(c) for c in conts), default=0) for ctx, conts in encoded]


def acc(logprobs: Sequence[float], target: int) -> float:
    return float(_argmax(logprobs) == target)


def continuations(task: TaskSpec, choices: Sequence[str]) -> list[str]:
    """What the engine scores after the prompt for each choice: the task's target_delimiter, then the choice
    (lm-eval's `target_delimiter + choice`)."""
    return [task.delimiter + c for c in choices]


def acc_norm(logprobs: Sequence[float], choices: Sequence[str], target: int) -> float:
    """lm-eval's acc_norm: acc with each choice's sum divided by the choice's length in characters, the
    choice as the data writes it (without the target_delimiter, as lm-eval measures it)."""
    return float(_argmax([lp / max(1, len(c)) for lp, c in zip(logprobs, choices)]) == target)


def acc_bytes(logprobs: Sequence[float], choices: Sequence[str], target: int) -> float:
    """lm-eval's acc_bytes: the same, by the choice's length in UTF-8 bytes (equal to acc_norm for ASCII)."""
    return float(_argmax([lp / max(1, len(c.encode("utf-8"))) for lp, c in zip(logprobs, choices)]) == target)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def rolling_windows(tokens: Sequence[int], prefix: int, window: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's loglikelihood_rolling windows of a document's tokens (its `get_rolling_token_windows` with
    `context_len=1`, then `make_disjoint_window`): (context, continuation) pairs whose continuations cover
    every token once. The first predicts up to `window` tokens from the prefix token; each later one the next
    `window` (or fewer) from the tokens before them, so no sequence the engine runs is longer than window + 1.
    lm-eval's vLLM backend uses window = max_model_len - 2 (one token
    for the context it adds, one that vLLM generates); raysweep does the same."""
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(window, len(tokens))
    pairs = [([prefix] + tokens[:first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        size = min(len(tokens) - done, window)
        end = done + size
        pairs.append((tokens[max(0, end - window - 1):end - 1], tokens[end - size:end]))
        done = end
    return [(ctx[:len(ctx) - (len(cont) - 1)], cont) for ctx, cont in pairs]


def rolling_length(n_tokens: int, window: int) -> int:
    """The longest sequence (context + continuation) of a document's rolling windows: what planning measures."""
    return min(n_tokens, window) + 1 if n_tokens else 0
