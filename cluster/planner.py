"""Planning (DESIGN §3): prompts measured in tokens, the length policy applied, tasks cut into shards.

1. Render each task's prompts for the model and measure them in tokens with the model's own tokenizer
   (batched; counts cached per tokenizer and prompt hash, cluster/token_cache.py).
2. Apply the task's length policy against `max_model_len - max_tokens` (error | truncate_left | skip).
3. Sort samples by length and cut shards by `max_samples` and the token budget (prompt + max_tokens).
4. Give each shard an engine profile: `long` (chunked prefill, chunk = the threshold) or `short`.

Shards carry prompt text and its measured length; actors tokenize their own shards (and check the
count), so the driver never holds every token id of a sweep. Only truncated rows carry their ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from cluster.data import TaskData, render_prompts
from cluster.spec import ModelSpec, ShardLimits, TaskSpec
from cluster.token_cache import TokenCache

SHORT, LONG = "short", "long"
TOKENIZE_BATCH = 8192
DEFAULT_CHUNK = 2048  # chunk size when a task forces chunked prefill on and the data gives no threshold


class PreflightError(ValueError):
    """Rows that cannot run under the task's length policy; the message lists them."""


@dataclass(frozen=True)
class Shard:
    shard_id: str  # "<model>/<task>/<index:05d>", stable for the same spec and data
    index: int
    model: str
    task: str
    profile: str  # short | long
    max_num_batched_tokens: int | None  # the chunk size for `long` shards
    add_special_tokens: bool  # how the prompts are tokenized (False for chat-rendered text)
    rows: pa.Table  # sample_id, prompt, prompt_token_ids (truncated rows only), prompt_tokens, seed, status

    @property
    def n_samples(self) -> int:
        return self.rows.num_rows


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
    limit: int | None = None  # max prompt tokens allowed (max_model_len - max_tokens)
    targets: dict = field(default_factory=dict)  # sample_id -> target, for scoring on the driver


def chunk_threshold(lengths: np.ndarray) -> int | None:
    """DESIGN §3: off if the longest prompt is under 1,000 tokens; 2,048 if p95 < 2,048; else 0.8 x p95."""
    if len(lengths) == 0 or lengths.max() < 1000:
        return None
    p95 = float(np.percentile(lengths, 95))
    return 2048 if p95 < 2048 else int(0.8 * p95)


def sample_seed(base: int, task: str, sample_id: str) -> int:
    digest = hashlib.blake2b(f"{base}\0{task}\0{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def _encodings(prompts: list[str], tokenizer, add_special_tokens: bool):
    """Encodings from a fast tokenizer's Rust backend, called directly: the same ids as `tokenizer(...)`
    without transformers' per-encoding Python conversion; `encode_batch_fast` also skips offsets.
    None where the tokenizer has no Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return (e for start in range(0, len(prompts), TOKENIZE_BATCH)
            for e in encode(prompts[start:start + TOKENIZE_BATCH], add_special_tokens=add_special_tokens))


def tokenize(prompts: list[str], tokenizer, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of every prompt, in batches."""
    encodings = _encodings(prompts, tokenizer, add_special_tokens)
    if encodings is not None:
        return [e.ids for e in encodings]
    return tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]


def count_tokens(prompts: list[str], tokenizer, add_special_tokens: bool) -> list[int]:
    """Token counts of every prompt (no id lists built where the Rust backend is there)."""
    encodings = _encodings(prompts, tokenizer, add_special_tokens)
    if encodings is not None:
        return [len(e) for e in encodings]
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]]


def plan_task(model: ModelSpec, data: TaskData, tokenizer, max_model_len: int | None, limits: ShardLimits,
              cache: TokenCache | None = None, strict: bool = True) -> TaskPlan:
    task = data.task
    prompts, add_special = render_prompts(data, tokenizer)
    if cache is not None:
        lengths = cache.lengths(prompts, add_special, lambda ps: count_tokens(ps, tokenizer, add_special))
    else:
        lengths = np.asarray(count_tokens(prompts, tokenizer, add_special), dtype=np.int64)
    status = np.full(len(prompts), "ok", dtype=object)
    truncated: dict[int, list[int]] = {}
    limit = None if max_model_len is None else max_model_len - task.sampling.max_tokens
    n_refused = 0
    if limit is not None:
        over = np.flatnonzero(lengths > limit)
        if len(over) and task.length_policy == "error":
            if strict:
                raise PreflightError(_refusal(model, task, data, over, lengths, limit, max_model_len))
            n_refused = len(over)
        elif task.length_policy == "truncate_left" and len(over):
            for i, ids in zip(over, tokenize([prompts[i] for i in over], tokenizer, add_special)):
                truncated[int(i)] = ids[len(ids) - limit:] if limit > 0 else []
                lengths[i], status[i] = len(truncated[int(i)]), "truncated"
        elif task.length_policy == "skip":
            status[over] = "skipped"
    threshold = _threshold(task, lengths[status != "skipped"])
    order = np.argsort(lengths, kind="stable")
    shards = [_make_shard(model, task, n, part, data, prompts, truncated, lengths, status, threshold, add_special)
              for n, part in enumerate(_cut(order, lengths, task.sampling.max_tokens, limits))]
    return TaskPlan(model=model, task=task, shards=shards, lengths=lengths, threshold=threshold,
                    n_truncated=int((status == "truncated").sum()), n_skipped=int((status == "skipped").sum()),
                    n_refused=n_refused, limit=limit, targets=dict(zip(data.sample_ids, data.targets())))


def _refusal(model, task, data, over, lengths, limit, max_model_len) -> str:
    listed = "; ".join(f"sample_id={data.sample_ids[i]} tokens={lengths[i]}" for i in over[:10])
    more = f" (and {len(over) - 10} more)" if len(over) > 10 else ""
    return (f"task {task.name} on model {model.name}: {len(over)} prompt(s) over the limit of {limit} tokens "
            f"(max_model_len {max_model_len} - max_tokens {task.sampling.max_tokens}): {listed}{more}. "
            f"Set the task's length_policy to truncate_left or skip to run them anyway.")


def _threshold(task: TaskSpec, lengths: np.ndarray) -> int | None:
    """The long-prompt threshold: from the data, or forced by the task's `chunked_prefill`."""
    if task.chunked_prefill == "off":
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


def _make_shard(model: ModelSpec, task: TaskSpec, n: int, part: np.ndarray, data: TaskData, prompts: list[str],
                truncated: dict, lengths: np.ndarray, status: np.ndarray, threshold: int | None,
                add_special: bool) -> Shard:
    sample_ids = [data.sample_ids[i] for i in part]
    rows = pa.table({
        "sample_id": pa.array(sample_ids, pa.string()),
        "prompt": pa.array([prompts[i] for i in part], pa.string()),
        "prompt_token_ids": pa.array([truncated.get(int(i)) for i in part], pa.list_(pa.int32())),
        "prompt_tokens": pa.array(lengths[part], pa.int32()),
        "seed": pa.array([sample_seed(task.sampling.seed, task.name, s) for s in sample_ids], pa.int64()),
        "status": pa.array(status[part].tolist(), pa.string()),
    })
    longest = int(lengths[part].max()) if len(part) else 0
    is_long = threshold is not None and (task.chunked_prefill == "on" or longest > threshold)
    return Shard(shard_id=f"{model.name}/{task.name}/{n:05d}", index=n, model=model.name, task=task.name,
                 profile=LONG if is_long else SHORT, max_num_batched_tokens=threshold if is_long else None,
                 add_special_tokens=add_special, rows=rows)
