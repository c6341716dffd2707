"""Planning (DESIGN §3): prompts measured in tokens, the length policy applied, tasks cut into shards.

1. Render each task's prompts for the model and tokenize them with the model's own tokenizer (batched).
2. Apply the task's length policy against `max_model_len - max_tokens` (error | truncate_left | skip).
3. Sort samples by length and cut shards by `max_samples` and the token budget (prompt + max_tokens).
4. Give each shard an engine profile: `long` (chunked prefill, chunk = the threshold) or `short`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from cluster.data import TaskData, render_prompts
from cluster.spec import ModelSpec, ShardLimits, TaskSpec

SHORT, LONG = "short", "long"
TOKENIZE_BATCH = 8192


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
    rows: pa.Table  # sample_id, prompt_token_ids, prompt_tokens, seed, status (ok | truncated | skipped)

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


def tokenize(prompts: list[str], tokenizer, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of every prompt, in batches. A fast tokenizer's Rust backend is called directly:
    the same ids as `tokenizer(...)`, without transformers' per-encoding Python conversion (3x faster)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    ids: list[list[int]] = []
    for start in range(0, len(prompts), TOKENIZE_BATCH):
        batch = prompts[start:start + TOKENIZE_BATCH]
        if backend is not None:
            ids.extend(e.ids for e in backend.encode_batch(batch, add_special_tokens=add_special_tokens))
        else:
            ids.extend(tokenizer(batch, add_special_tokens=add_special_tokens)["input_ids"])
    return ids


def plan_task(model: ModelSpec, data: TaskData, tokenizer, max_model_len: int | None,
              limits: ShardLimits) -> TaskPlan:
    task = data.task
    prompts, add_special = render_prompts(data, tokenizer)
    ids = tokenize(prompts, tokenizer, add_special)
    status = ["ok"] * len(ids)
    limit = None if max_model_len is None else max_model_len - task.sampling.max_tokens
    if limit is not None:
        over = [i for i, row in enumerate(ids) if len(row) > limit]
        if over and task.length_policy == "error":
            listed = "; ".join(f"sample_id={data.sample_ids[i]} tokens={len(ids[i])}" for i in over[:10])
            more = f" (and {len(over) - 10} more)" if len(over) > 10 else ""
            raise PreflightError(
                f"task {task.name} on model {model.name}: {len(over)} prompt(s) over the limit of {limit} tokens "
                f"(max_model_len {max_model_len} - max_tokens {task.sampling.max_tokens}): {listed}{more}. "
                f"Set the task's length_policy to truncate_left or skip to run them anyway.")
        for i in over:
            if task.length_policy == "truncate_left":
                ids[i], status[i] = ids[i][len(ids[i]) - limit:] if limit > 0 else [], "truncated"
            else:
                status[i] = "skipped"
    lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=len(ids))
    threshold = chunk_threshold(lengths[np.array([s != "skipped" for s in status], dtype=bool)])
    order = np.argsort(lengths, kind="stable")
    shards = [_make_shard(model, task, n, part, data, ids, lengths, status, threshold)
              for n, part in enumerate(_cut(order, lengths, task.sampling.max_tokens, limits))]
    return TaskPlan(model=model, task=task, shards=shards, lengths=lengths, threshold=threshold,
                    n_truncated=status.count("truncated"), n_skipped=status.count("skipped"), limit=limit,
                    targets=dict(zip(data.sample_ids, data.targets())))


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


def _make_shard(model: ModelSpec, task: TaskSpec, n: int, part: np.ndarray, data: TaskData,
                ids: list[list[int]], lengths: np.ndarray, status: list[str], threshold: int | None) -> Shard:
    sample_ids = [data.sample_ids[i] for i in part]
    rows = pa.table({
        "sample_id": pa.array(sample_ids, pa.string()),
        "prompt_token_ids": pa.array([ids[i] for i in part], pa.list_(pa.int32())),
        "prompt_tokens": pa.array(lengths[part], pa.int32()),
        "seed": pa.array([sample_seed(task.sampling.seed, task.name, s) for s in sample_ids], pa.int64()),
        "status": pa.array([status[i] for i in part], pa.string()),
    })
    longest = int(lengths[part].max()) if len(part) else 0
    is_long = threshold is not None and longest > threshold
    return Shard(shard_id=f"{model.name}/{task.name}/{n:05d}", index=n, model=model.name, task=task.name,
                 profile=LONG if is_long else SHORT, max_num_batched_tokens=threshold if is_long else None,
                 rows=rows)
