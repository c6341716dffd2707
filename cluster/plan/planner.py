"""Planning (docs/design.md, Planning): prompts measured in tokens, the length policy applied, tasks cut into shards.

1. Render each task's prompts for the model and measure them in tokens with the model's own tokenizer
   (batched; counts cached per tokenizer and prompt hash, cluster/inputs/token_cache.py).
2. Apply the task's length policy against `max_model_len - max_tokens` (error | truncate_left | skip).
3. Sort samples by length and cut shards by `max_samples` and the token budget (prompt + max_tokens).
4. Give each shard an engine profile: `long` (chunked prefill, chunk = the threshold) or `short`.

The data is streamed in batches and each batch's rendered prompts are staged on local disk
(cluster/inputs/staging.py); a shard holds positions into that file and reads its rows when it is dispatched.
The driver keeps numpy arrays per sample (length, status, offset, sort order), not the prompts:
planning 1M prompts grew its peak by about 0.1 KB per sample (bench/records/cpu-planning-streamed.md).
Shards carry prompt text and its measured length; actors tokenize their own shards (and check the
count), so the driver never holds every token id of a sweep. Only truncated rows carry their ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.contracts.errors import PreflightError
from cluster.contracts.shard import LONG, SHORT, Shard
from cluster.contracts.tokens import count_tokens, tokenize
from cluster.inputs.data import RowBatch, TaskData
from cluster.contracts.loglikelihood import continuations, encode_pairs, pair_lengths, rolling_length, row_choices
from cluster.contracts.spec import ModelSpec, ShardLimits, TaskSpec
from cluster.contracts.task_spec import no_room
from cluster.inputs.staging import StagedRows, StagingFolder
from cluster.inputs.token_cache import TokenCache

DEFAULT_CHUNK = 2048  # chunk size when a task forces chunked prefill on and the data gives no threshold


@dataclass
class TaskPlan:
    model: ModelSpec
    task: TaskSpec
    shards: list[Shard]
    lengths: np.ndarray  # prompt tokens per sample, after the length policy
    threshold: int | None  # long-prompt threshold from the data; None = chunked prefill off
    n_truncated: int = 0
    n_skipped: int = 0
    n_refused: int = 0  # over the limit under length_policy error (only a non-strict plan gets this far)
    n_empty: int = 0  # prompts of 0 tokens: error rows (fail_on_error false or a fraction), else refused
    limit: int | None = None  # max prompt tokens allowed (max_model_len - max_tokens)


def chunk_threshold(lengths: np.ndarray) -> int | None:
    """The chunked-prefill threshold (docs/design.md, Planning): off if the longest prompt is under 1,000
    tokens; 2,048 if p95 < 2,048; else 0.8 x p95."""
    if len(lengths) == 0 or lengths.max() < 1000:
        return None
    p95 = float(np.percentile(lengths, 95))
    return 2048 if p95 < 2048 else int(0.8 * p95)


def _token_counts(model: ModelSpec, data: TaskData, batch, prompts: list[str], extras: list[dict], tokenizer,
                  add_special: bool, max_model_len: int | None, cache: TokenCache | None) -> np.ndarray:
    """Each row's tokens as the engine will run them."""
    task = data.task
    if task.rolling:  # lm-eval's windows: no sequence longer than the model's length less 1 (its vLLM model's)
        return np.asarray(_rolling_lengths(model, task, extras, tokenizer, add_special, max_model_len), np.int64)
    if task.loglikelihood:  # the longest context + choice the engine runs (no cache: keyed by prompt alone)
        encoded = encode_pairs(prompts, [continuations(task, e["choices"]) for e in extras], tokenizer, add_special)
        _check_pairs(model, task, data.path, batch, prompts, encoded)
        return np.asarray(pair_lengths(encoded), dtype=np.int64)
    if cache is not None:
        return cache.lengths(prompts, add_special, lambda ps: count_tokens(ps, tokenizer, add_special))
    return np.asarray(count_tokens(prompts, tokenizer, add_special), dtype=np.int64)


def plan_task(model: ModelSpec, data: TaskData, tokenizer, max_model_len: int | None, limits: ShardLimits,
              cache: TokenCache | None = None, strict: bool = True, staging: StagingFolder | None = None) -> TaskPlan:
    task = data.task
    limit = None if max_model_len is None else max_model_len - task.sampling.max_tokens
    if limit is not None and limit <= 0:  # no policy helps: every prompt is over, even an empty one
        raise PreflightError(no_room(model, task, max_model_len))
    # "+" is in no model or task name (spec.NAME_RE): no two (model, task) pairs share a file
    staged = StagedRows(staging or StagingFolder(), f"{model.name}+{task.name}")
    lengths, status, over_list, empty_list = [], [], [], []
    add_special = True
    with data.read_again():
        for rendered in data.rendered(tokenizer):
            batch, prompts, extras, add_special = rendered.rows, rendered.prompts, rendered.extras, rendered.add_special
            counts = _token_counts(model, data, batch, prompts, extras, tokenizer, add_special, max_model_len, cache)
            codes = np.zeros(len(prompts), dtype=np.uint8)
            truncated: dict[int, list[int]] = {}
            over = np.flatnonzero(counts > limit) if limit is not None else np.empty(0, np.int64)
            if len(over) and task.length_policy == "error":
                over_list.extend((batch.ids[k], int(counts[k])) for k in over)
            elif len(over) and task.length_policy == "truncate_left" and task.loglikelihood:
                for k in over:  # an lm-eval task's context, cut per choice on the actor (actors/shard_work.py)
                    counts[k], codes[k], extras[k]["window"] = limit, 1, limit - 1
            elif len(over) and task.length_policy == "truncate_left":
                for k, ids in zip(over, tokenize([prompts[k] for k in over], tokenizer, add_special)):
                    truncated[int(k)] = ids[len(ids) - limit:] if limit > 0 else []
                    counts[k], codes[k] = len(truncated[int(k)]), 1
            elif len(over) and task.length_policy == "skip":
                codes[over] = 2
            empty = np.flatnonzero((counts == 0) & (codes != 2))
            if len(empty):  # no engine runs an empty prompt: an error row now, not a shard failing three times
                codes[empty] = 3
                empty_list.extend((batch.ids[k], batch.where[k]) for k in empty)
            staged.append(batch.ids, prompts, rendered.targets, truncated, extras)
            lengths.append(counts.astype(np.int32))
            status.append(codes)
    staged.close()
    if cache is not None:
        cache.flush()
    if over_list and strict:
        raise PreflightError(_refusal(model, task, over_list, limit, max_model_len))
    n_rows = sum(len(c) for c in status)
    allowed = 0 if task.fail_on_error is True else n_rows if task.fail_on_error is False else task.fail_on_error * n_rows
    if len(empty_list) > allowed and strict:
        raise PreflightError(_empty_refusal(task, data.path, empty_list, allowed))
    lengths_all = np.concatenate(lengths) if lengths else np.empty(0, np.int32)
    status_all = np.concatenate(status) if status else np.empty(0, np.uint8)
    threshold = _threshold(task, lengths_all[status_all < 2])
    order = np.argsort(lengths_all, kind="stable")
    shards = [_make_shard(model, task, k, part, staged, lengths_all, status_all, threshold, add_special)
              for k, part in enumerate(_cut(order, lengths_all, task.sampling.max_tokens, limits))]
    return TaskPlan(model=model, task=task, shards=shards, lengths=lengths_all, threshold=threshold,
                    n_truncated=int((status_all == 1).sum()), n_skipped=int((status_all == 2).sum()),
                    n_refused=len(over_list), n_empty=len(empty_list), limit=limit)


def plan_replay(data: TaskData, limits: ShardLimits, staging: StagingFolder | None = None) -> TaskPlan:
    """A replay task's plan: its completions come from the data, so nothing is measured in tokens and no
    model's tokenizer is needed; shards of `max_samples` rows in file order, under `replay.model`."""
    task = data.task
    model = ModelSpec(task.replay.model, "replay")
    staged = StagedRows(staging or StagingFolder(), f"{model.name}+{task.name}")
    with data.read_again():
        for rendered in data.rendered(None):
            staged.append(rendered.rows.ids, rendered.prompts, rendered.targets, {}, rendered.extras)
    staged.close()
    n = data.n_rows
    zeros = np.zeros(n, np.int32)
    shards = [_make_shard(model, task, k, np.arange(start, min(n, start + limits.max_samples)), staged, zeros,
                          np.zeros(n, np.uint8), None, True)
              for k, start in enumerate(range(0, n, limits.max_samples))]
    return TaskPlan(model=model, task=task, shards=shards, lengths=zeros, threshold=None)


def _refusal(model, task, over: list[tuple[str, int]], limit, max_model_len) -> str:
    listed = "; ".join(f"sample_id={sid} tokens={tokens}" for sid, tokens in over[:10])
    more = f" (and {len(over) - 10} more)" if len(over) > 10 else ""
    return (f"task {task.name} on model {model.name}: {len(over)} prompt(s) over the limit of {limit} tokens "
            f"(max_model_len {max_model_len} - max_tokens {task.sampling.max_tokens}): {listed}{more}. "
            + ("lm-eval's models would cut the context from the left; raysweep does not cut a context a choice is "
               "scored on: raise the model's engine.max_model_len, or lower the entry's num_fewshot"
               if task.lm_eval is not None and task.loglikelihood else
               "Set the task's length_policy to truncate_left or skip to run them anyway."))


def _empty_refusal(task: TaskSpec, path: str, empty: list[tuple[str, str]], allowed: float) -> str:
    listed = "; ".join(f"{path}:{where} sample_id={sid}" for sid, where in empty[:5])
    more = f" (and {len(empty) - 5} more)" if len(empty) > 5 else ""
    policy = ("set the task's fail_on_error to false (or a fraction) to record them as error rows"
              if task.fail_on_error is True else f"more than fail_on_error={task.fail_on_error} allows")
    return f"task {task.name}: {len(empty)} prompt(s) empty after rendering (0 tokens): {listed}{more}; {policy}"


def _check_pairs(model: ModelSpec, task: TaskSpec, path: str, batch: RowBatch, prompts: list[str],
                 encoded: list[tuple[list[int], list[list[int]]]]) -> None:
    """A choice is scored on the tokens before it: the context must hold one and each choice one of its own
    (lm-eval asserts both). Refused here, naming the row, rather than failing its shard at the engine."""
    for k, (ctx, conts) in enumerate(encoded):
        at = f"{path}:{batch.where[k]}: tasks.{task.name}"
        if not ctx and prompts[k] == "":
            raise PreflightError(f"{at}.prompt renders an empty context, which lm-eval replaces with the BOS or "
                                 f"EOS token, and model {model.name}'s tokenizer has neither")
        if not ctx:
            raise PreflightError(f"{at}.prompt renders {prompts[k]!r}, a context of 0 tokens for model "
                                 f"{model.name} once its trailing whitespace moves to the choices (as lm-eval "
                                 "splits them): give it some text, or render it as \"\" (then BOS or EOS stands "
                                 "for it)")
        empty = next((j for j, c in enumerate(conts) if not c), None)
        if empty is not None:
            choice = row_choices(task, batch.rows[k])[empty]
            raise PreflightError(f"{at}.choices: choice {empty} ({choice!r}) is 0 tokens after the context "
                                 f"{prompts[k][-20:]!r} for model {model.name} (its tokenizer merges the choice "
                                 "into the context's end): it leaves nothing to score")


def _rolling_lengths(model: ModelSpec, task: TaskSpec, extras: list[dict], tokenizer, add_special: bool,
                     max_model_len: int | None) -> list[int]:
    """Each rolling row's longest window, the window size kept on the row for the actor (lm-eval's vLLM
    model's: max_model_len - 2, one token for the context and one the engine generates)."""
    if max_model_len is None or max_model_len < 3:
        raise PreflightError(f"tasks.{task.name}: loglikelihood_rolling needs model {model.name}'s length (set "
                             f"engine.max_model_len to 3 or more), got {max_model_len}")
    window = max_model_len - 2
    for extra in extras:
        extra["window"] = window
    return [rolling_length(len(ids), window)
            for ids in tokenize([e["choices"][0] for e in extras], tokenizer, add_special)]


def _threshold(task: TaskSpec, lengths: np.ndarray) -> int | None:
    """The long-prompt threshold: from the data, or forced by the task's `chunked_prefill`. A log-likelihood
    task's shards are all `short` unless it says `on`: chunked prefill keeps decoding sequences moving while a
    long prompt fills, and these requests decode nothing; without it every prompt up to max_model_len runs in
    one step (vLLM's token budget is then at least max_model_len), and no engine restarts for a profile."""
    if task.chunked_prefill == "off" or (task.loglikelihood and task.chunked_prefill != "on"):
        return None
    found = chunk_threshold(lengths)
    if task.chunked_prefill == "on":
        return found or DEFAULT_CHUNK
    return found


def _cut(order: np.ndarray, lengths: np.ndarray, max_tokens: int, limits: ShardLimits) -> list[np.ndarray]:
    """Consecutive runs of the length-sorted order, each within max_samples and the token budget
    (a single sample over the budget gets a shard of its own)."""
    parts, start, budget = [], 0, 0
    for pos, i in enumerate(order):
        cost = int(lengths[i]) + max_tokens
        if pos > start and (pos - start >= limits.max_samples or budget + cost > limits.max_tokens):
            parts.append(order[start:pos])
            start, budget = pos, 0
        budget += cost
    if start < len(order):
        parts.append(order[start:])
    return parts


def _make_shard(model: ModelSpec, task: TaskSpec, n: int, part: np.ndarray, staged: StagedRows,
                lengths: np.ndarray, status: np.ndarray, threshold: int | None, add_special: bool) -> Shard:
    longest = int(lengths[part].max()) if len(part) else 0
    is_long = threshold is not None and (task.chunked_prefill == "on" or longest > threshold)
    return Shard(shard_id=f"{model.name}/{task.name}/{n:05d}", index=n, model=model.name, task=task.name,
                 profile=LONG if is_long else SHORT, max_num_batched_tokens=threshold if is_long else None,
                 add_special_tokens=add_special, seed_base=task.sampling.seed, source=staged,
                 positions=part, prompt_tokens=lengths[part], status=status[part])
