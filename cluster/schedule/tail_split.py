"""Balanced tails: as a model's work runs out, its last shards are cut smaller, so that no actor
idles while another finishes a long shard; and how long actors did idle at the tail, per run.

1. When (`split_tail`): planning is over, the model runs on two actors or more, or on the pool, counting
   actors whose engine for it is still starting (the first engine up must not take every shard while the
   second starts: on an H100, two engines idled 33% at the tail of 1,312 prompts in 3 shards,
   bench/records/h100-engines-per-gpu-compiled.md), and either fewer shards wait in its queues than its actors
   hold at once (their shards in flight), or the largest waiting shard holds more than its share of the model's
   rows left (waiting and in flight) per shard the actors hold (`too_large`). The largest waiting whole shard on
   its first attempt (MIN_PART_ROWS rows or more per half; one, for a shard of long prompts) is cut in halves,
   again until neither holds or nothing is left to cut. The pool's replicas balance what reaches them, but not within a shard: its slot
   counts by the shards the pool holds at once.
2. Parts run as jobs of their own (same shard id, `Shard.piece`, as bisection's parts do) and are
   committed together as the shard, once, under its id: a driver killed meanwhile commits nothing of it,
   and the resume runs it again. A part that raises ends the split: the whole shard goes back to its queue
   as a failed attempt (retried or bisected as any shard is); a part whose actor died is retried alone.
3. Tail idle (`TailClock`): for each actor, the time from its last shard's end to the end of the run's last
   shard, weighted by its GPUs (an actor on CPUs counts 1), against the same actors' time from their first
   shard to that end: the share of the sweep's GPU-seconds left idle while others finished. An actor
   released because no model needs it counts as idle to the end (on a fixed cluster its GPU idles); one that
   died counts only up to its death (its replacement is an actor of its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cluster.contracts.shard import LONG
from cluster.schedule.bisection import Piece
from cluster.schedule.work import FREE, SERVING, Job

MIN_PART_ROWS = 16  # no part of a split shard is smaller


@dataclass(eq=False)
class TailSplit:
    """One shard cut in parts at its model's tail; the interface bisection's parts use (`Piece.bisection`)."""
    job: Any  # the whole shard's Job
    pending: int = 0
    tables: dict[int, pa.Table] = field(default_factory=dict)  # start -> the part's results
    gave_up: str | None = None  # a part raised: the whole shard is retried instead
    reported: bool = False

    def start(self, parts: int = 2) -> list[Piece]:
        n = self.job.shard.n_samples
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        self.pending = parts
        return [Piece(self, a, b, 1, self.job.shard.piece(a, b)) for a, b in zip(bounds, bounds[1:])]

    @property
    def settled(self) -> bool:
        return self.gave_up is not None or self.pending == 0

    def part_ran(self, piece: Piece, table: pa.Table) -> list[Piece]:
        self.pending -= 1
        if not self.gave_up:
            self.tables[piece.start] = table
        return []

    def abandon(self, error: str) -> None:
        self.gave_up = self.gave_up or error

    def table(self) -> pa.Table:
        return pa.concat_tables([self.tables[start] for start in sorted(self.tables)])

    def row_errors(self) -> dict[str, str]:
        return {}


def split_tail(model, slots: list, in_flight: int) -> int:
    """Step 1 for `model` (cluster/schedule/work.py ModelWork), on the sweep's `slots`, with `in_flight` rows of
    its shards running: how many of its waiting shards were cut. Its slots hold their shards in flight each; the
    actors still importing, or idle, that it will get count as its own (the first engine up must not take the
    work of the others); a pool slot's replicas count as its engines."""
    serving = [s for s in slots if s.model == model.name and s.state in SERVING]
    coming = max(min(model.max_actors - model.assigned,
                     sum(s.model is None and s.shape == model.shape and s.state in FREE for s in slots)), 0)
    holds = sum(s.depth or model.depth for s in serving) + coming * model.depth
    if holds < 2 or sum(s.replicas or 1 for s in serving) + coming < 2:
        return 0  # one actor (or one pool replica) takes every shard anyway
    return cut_waiting(model.queues, holds, in_flight)


def too_large(rows: int, waiting: int, holds: int, rows_left: int) -> bool:
    """Whether a waiting shard of `rows` rows is to be cut: fewer shards wait (`waiting`) than the model's actors
    hold at once (`holds`), or it holds more rows than `rows_left` (the model's rows waiting and in flight) over
    `holds`, its fair part of what is left."""
    return waiting < holds or rows > rows_left / holds


def cut_waiting(queues: dict, holds: int, in_flight: int) -> int:
    """Step 1 on a model's queues (profile -> deque of Jobs): cut the largest waiting whole shard in halves,
    in place, while `too_large` says so (`holds`: the shards its actors hold at once; `in_flight`: the rows of
    its shards running). Returns how many shards were cut."""
    cuts = 0
    while waiting := [j for q in queues.values() for j in q]:
        whole = max((j for j in waiting if splittable(j)), key=lambda j: j.shard.n_samples, default=None)
        if whole is None or not too_large(whole.shard.n_samples, len(waiting), holds,
                                          in_flight + sum(j.shard.n_samples for j in waiting)):
            return cuts
        queue = queues[whole.shard.profile]
        at = queue.index(whole)
        del queue[at]
        for offset, piece in enumerate(TailSplit(whole).start()):
            queue.insert(at + offset, Job(piece.shard, whole.task, piece=piece))
        cuts += 1
    return cuts


def splittable(job) -> bool:
    """A whole shard on its first attempt (a retried one runs whole: its failure may repeat), large enough:
    two parts of MIN_PART_ROWS rows, or, for a shard of long prompts (the `long` profile: each row a chunked
    prefill of thousands of tokens, so a part's overhead is small beside it), two rows. (On an H100, two
    actors idled 49.7% at the tail of a sweep whose one long shard of 8 prompts could not be cut.)"""
    if job.piece is not None or job.attempt != 1:
        return False
    return job.shard.n_samples >= (2 if job.shard.profile == LONG else 2 * MIN_PART_ROWS)


def tail_line(record: dict, unit: str) -> str | None:
    """The driver's line on the run's tail (`record`: TailClock.record and the splits), None where no shard
    came back; `unit`: GPU-seconds, or actor-seconds on CPUs."""
    if record["tail_idle_share"] is None:
        return None
    return (f"[raysweep] tail: actors idle {record['tail_idle_share']:.1%} of their {unit} "
            f"({record['tail_idle_gpu_s']:.1f}) while others finished; {record['tail_splits']} shard(s) cut at "
            "their model's tail")


class TailClock:
    """When each actor ran its first and its last shard; the run's tail idle from those."""

    def __init__(self) -> None:
        self.actors: dict[int, list] = {}  # actor number -> [weight, first shard sent, last shard back, died]

    def sent(self, number: int, weight: float) -> None:
        self.actors.setdefault(number, [weight, time.time(), None, None])

    def died(self, number: int) -> None:
        if number in self.actors:
            self.actors[number][3] = time.time()

    def back(self, number: int) -> None:
        if number in self.actors:
            self.actors[number][2] = time.time()

    def record(self) -> dict:
        """tail_idle_gpu_s (GPU-seconds, actor-seconds on CPUs) and tail_idle_share of the actors' time from
        their first shard to the run's last; None where no shard came back."""
        done = [(w, first, last, died) for w, first, last, died in self.actors.values() if last is not None]
        if not done:
            return {"tail_idle_gpu_s": None, "tail_idle_share": None}
        end = max(last for _, _, last, _ in done)
        stops = [(w, first, last, min(end, died) if died is not None else end) for w, first, last, died in done]
        held = sum(w * (stop - first) for w, first, _, stop in stops)
        idle = sum(w * max(stop - last, 0.0) for w, _, last, stop in stops)
        return {"tail_idle_gpu_s": round(idle, 3), "tail_idle_share": round(idle / held, 4) if held > 0 else 0.0}
