"""Bisection: the rows of a shard that fails the same way on every attempt still run, and the rows that
cause the failure become error rows with their error.

1. When: a whole shard's attempt raised (its actor lived) and either raised the same error on the attempt
   before, or was its last attempt (`should_bisect`, called by cluster/schedule/scheduler.py). An actor's death is never
   bisected: a row that kills the engine's process would cost an engine start per part tried (minutes
   under vLLM) and trip the scheduler's limit on actor deaths, so such a shard fails whole, as before.
2. How: the shard is cut into halves, run as jobs of their own (same shard id, `Shard.piece`). A part
   that runs keeps its results; a part that raises is not tried again (its failure is known to repeat)
   but cut again, down to single rows: a single row that raises is an error row, its error the one the
   engine raised for it alone. A part whose actor dies is retried like any job.
3. Evidence: a row is blamed only when other rows of its shard ran (generated) on the same engine. Until
   some part has run, parts failing at depth 2 (the quarters) wait; if every part up to there failed,
   the failure is the shard's, not a row's, and the shard fails whole as before after at most six parts
   (an engine that fails every call does not turn a shard into a thousand single-row jobs of error rows).
4. Commit: once every part is settled, the parts' results and the error rows are put together in the
   shard's order and committed as the shard, once, under its own id (the manifest/commit model is per
   shard; a driver that dies meanwhile commits nothing, and the resume starts the shard again).
5. Policy: the task's `fail_on_error` judges the committed shard (cluster/schedule/commit.py
   `row_error_excess`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cluster.contracts.shard import RowStatus, Shard

EVIDENCE_DEPTH = 2  # parts deeper than the quarters wait until some part of the shard has run
DIED = "actor died: "  # how the scheduler records an attempt whose actor died


def should_bisect(job, died: bool, max_attempts: int) -> bool:
    """After a whole shard's failed attempt (step 1): bisect when the shard raised (its actor lived) and either
    raised the same error on the attempt before (the repeat is the evidence that it repeats: no attempt more
    is spent on it) or has no attempt left. Never on an actor's death, nor for a single row."""
    if died or job.piece is not None or job.shard.n_samples < 2:
        return False
    repeated = len(job.errors) >= 2 and job.errors[-1] == job.errors[-2] and not job.errors[-2].startswith(DIED)
    return repeated or job.attempt >= max_attempts


@dataclass(eq=False)
class Piece:
    """Rows [start, stop) of a shard being bisected, in the shard's order."""
    bisection: "Bisection"
    start: int
    stop: int
    depth: int  # 1 for the halves
    shard: Shard  # the rows as a shard of their own

    @property
    def rows(self) -> str:
        """As telemetry names it: start:stop."""
        return f"{self.start}:{self.stop}"


@dataclass(eq=False)
class Bisection:
    """One shard being bisected: the results of its parts that ran, the rows that failed alone."""
    job: Any  # the whole shard's Job (cluster/schedule/work.py)
    pending: int = 0  # parts handed out and not settled yet
    parts_run: int = 0  # parts handed out in all
    tables: dict[int, pa.Table] = field(default_factory=dict)  # start -> results of a part that ran
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # row index -> (sample id, its error)
    parked: list[Piece] = field(default_factory=list)  # failed parts waiting for evidence (step 3)
    ran: bool = False  # some part generated a row
    last_error: str | None = None  # the latest part's error
    gave_up: str | None = None  # why the shard fails whole after all
    reported: bool = False  # the scheduler has told the sweep how it ended

    def start(self) -> list[Piece]:
        return self._halves(Piece(self, 0, self.job.shard.n_samples, 0, self.job.shard))

    @property
    def settled(self) -> bool:
        return self.gave_up is not None or self.pending == 0

    def part_ran(self, piece: Piece, table: pa.Table) -> list[Piece]:
        """A part came back with its results; returns the parts to run next."""
        self.pending -= 1
        if self.gave_up:
            return []
        self.tables[piece.start] = table
        statuses = table["status"].to_pylist()
        self.ran = self.ran or RowStatus.OK in statuses or RowStatus.TRUNCATED in statuses
        waiting, self.parked = (self.parked, []) if self.ran else ([], self.parked)
        return self._end_check([p for parked in waiting for p in self._halves(parked)])

    def part_failed(self, piece: Piece, error: str) -> list[Piece]:
        """A part raised; returns the parts to run next."""
        self.pending -= 1
        if self.gave_up:
            return []
        self.last_error = error
        if piece.stop - piece.start == 1:
            self.errors[piece.start] = (piece.shard.rows["sample_id"][0].as_py(), error)
            return self._end_check([])
        if self.ran or piece.depth < EVIDENCE_DEPTH:
            return self._end_check(self._halves(piece))
        self.parked.append(piece)
        return self._end_check([])

    def abandon(self, error: str) -> None:
        """A part could not be run (its actors died every attempt, its model's engine failed)."""
        self.gave_up = self.gave_up or f"bisection stopped: a part of the shard could not run: {error}"

    def table(self) -> pa.Table:
        """The shard's rows in its order: the parts' results, and an error row for each row that failed alone."""
        schema = next(iter(self.tables.values())).schema
        sampling = getattr(self.job.task, "sampling", None)
        completions = getattr(sampling, "n", 1) if getattr(self.job.task, "type", None) != "loglikelihood" else 1
        parts = []
        for start in sorted(self.tables.keys() | self.errors.keys()):
            if start in self.tables:
                parts.append(self.tables[start])
            else:
                sample_id, error = self.errors[start]
                # an error row per completion (sampling.n), as the rows that ran have: none of them ran, and
                # fail_on_error counts completions, as the actor does (actors/shard_work.py)
                error_row = {"sample_id": sample_id, "status": RowStatus.ERROR.value, "error": error}
                rows = [dict.fromkeys(schema.names) | error_row | {"completion": c} for c in range(completions)]
                parts.append(pa.Table.from_pylist(rows, schema=schema))
        return pa.concat_tables(parts)

    def row_errors(self) -> dict[str, str]:
        """{sample id: error} of the rows that failed alone."""
        return dict(self.errors[start] for start in sorted(self.errors))

    def _halves(self, piece: Piece) -> list[Piece]:
        mid = (piece.start + piece.stop) // 2
        halves = [Piece(self, a, b, piece.depth + 1, self.job.shard.piece(a, b))
                  for a, b in ((piece.start, mid), (mid, piece.stop))]
        self.pending += 2
        self.parts_run += 2
        return halves

    def _end_check(self, next_parts: list[Piece]) -> list[Piece]:
        if self.pending == 0 and not self.ran:
            self.gave_up = (f"bisected into {self.parts_run} parts, none of which ran: the failure is the "
                            f"shard's, not a row's; last: {self.last_error or self.job.errors[-1]}")
        return next_parts
