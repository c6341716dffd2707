"""A shard's results on their way from the scheduler to the output: the scheduler's events (SchedulerEvents,
cluster/schedule/work.py) into the sink.

1. Each result's telemetry is kept as it comes back: its engine starts, GPU readings and first token; a part
   of a shard being bisected or cut at its model's tail waits for its shard.
2. Each shard goes to the scorer (cluster/score/shard_scoring.py) and is committed as soon as its own scoring
   is done: a code_exec shard's programs run in the sandbox pool meanwhile and the scheduler goes on. A shard
   put together from its parts (bisected, with its error rows; or cut at the tail) goes the same way, once.
   Error rows past the task's fail_on_error are its manifest entry's error; a scorer that raises fails it.
   `fail_on_error` judges a committed shard as it judges row errors in an actor's batch
   (actors/evaluator.py `_generate`): `true` allows none, a fraction allows that share of the shard's rows,
   `false` any. A shard over it is still committed (its rows ran; every sample once) but recorded as failing
   the sweep (`row_error_excess`), and stays so on a resume: the spec and the data that decide it cannot
   change without --new-run. A bisected shard (cluster/schedule/bisection.py) is judged once, put together.
3. Failed attempts and failed shards are counted, logged and kept in the manifest and telemetry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from cluster.schedule.progress import SweepMetrics
from cluster.score.shard_scoring import ShardScorer
from cluster.schedule.work import Job
from cluster.store.sink import ResultSink
from cluster.store.telemetry_store import FIRST_TOKENS
from cluster.contracts.shard import EMPTY_PROMPT, RowStatus
from cluster.contracts.spec import SweepSpec
from cluster.contracts.timing import RunClock


@dataclass
class Scoring:
    """A shard on its way from the scorer to the sink."""
    job: Job
    telemetry: dict  # what the Ray metrics count when it is committed
    future: Any  # its scored results table
    extra: dict | None = None  # a shard put together from parts: more of its manifest entry (sink.commit)


class Commits:
    """The scheduler's events into the sink, the Ray metrics and progress; shards scored, then committed."""

    def __init__(self, spec: SweepSpec, sink: ResultSink, metrics: SweepMetrics, progress, clock: RunClock):
        self.sink, self.metrics, self.progress, self.clock = sink, metrics, progress, clock
        self.engine_rows: dict[tuple, dict] = {}  # (actor_id, start_index) -> its telemetry/actors row
        self.part_actors: dict[str, str] = {}  # shard being bisected -> the actor of its last part that ran
        self.scorer = ShardScorer(spec, on_sandbox=self.on_sandbox)
        self.scoring: list[Scoring] = []  # shards being scored, committed each as soon as its scoring is done

    def submit(self, job: Job, telemetry: dict, table: pa.Table, extra: dict | None = None) -> None:
        """A shard's results to the scorer; committed by commit_scored once scored."""
        shard = job.shard
        self.scoring.append(Scoring(job, telemetry, self.scorer.submit(shard.model, job.task, shard, table), extra))

    def close(self) -> None:
        self.scorer.close()

    def on_sandbox(self, isolation: str) -> None:
        """Where code_exec programs run, said in the log and kept in the manifest beside the results."""
        self.sink.manifest["sandbox"] = isolation
        self.progress.log(f"[raysweep] code_exec programs run sandboxed: {isolation}")

    def add_engine_row(self, row: dict) -> None:
        if row:
            self.engine_rows[(row["actor_id"], row["start_index"])] = row
            self.sink.add_telemetry("actors", row)
            self.sink.flush_telemetry(("actors",))  # on disk as it starts: a driver killed later keeps it
            if row.get("reason") == "weights":
                self.progress.log(f"[raysweep] weights loaded: model {row['model']} into the running {row['engine']} "
                                  f"engine on actor {row['actor_id'][:8]} (another checkpoint of its model), "
                                  f"{row['startup_s']:.1f}s after it was asked for")
            elif row.get("reason") != "profile":
                early = ", built before Ray was up" if row.get("engine_process") == "early" else ""
                self.progress.log(f"[raysweep] engine up: model {row['model']} ({row['engine']}) on actor "
                                  f"{row['actor_id'][:8]}, {row['startup_s']:.1f}s after it was asked for{early}")

    def on_result(self, job: Job, table: pa.Table, telemetry: dict) -> None:
        model, task = job.shard.model, job.task.name
        self.clock.mark("first_result", once=True)
        self.metrics.returned(model, task)
        telemetry.setdefault("served_by", "actor")  # a pool replica's says `pool:<replica>`
        self._add_shard_telemetry(job, telemetry)
        if job.piece is not None:  # a part of a shard being bisected: committed with the shard (on_bisected)
            self.part_actors[job.shard.shard_id] = telemetry["actor_id"]
            return
        self.submit(job, telemetry, table)
        self.commit_scored()

    def commit_scored(self, wait: bool = False) -> None:
        """Commit the shards whose scoring is done (all of them, waiting, with `wait`), each as soon as its own
        is: a code_exec shard's programs run in the sandbox pool meanwhile, the scheduler goes on, and shards
        scored sooner (another task's, a later one's) are not held in memory behind it."""
        for entry in [e for e in self.scoring if wait or e.future.done()]:
            self.scoring.remove(entry)
            job = entry.job
            try:
                scored = entry.future.result()
            except Exception as e:  # the scorer itself broke (not a program: those are rows' outcomes)
                self.on_attempt_failed(job, f"scoring failed: {type(e).__name__}: {e}")
                job.errors.append(f"scoring failed: {type(e).__name__}: {e}")
                self.on_failed(job)
                continue
            model, task = job.shard.model, job.task.name
            extra = entry.extra
            if extra is None and (excess := row_error_excess(job.task, scored)):
                extra = {"errors": [excess]}  # scoring made error rows (programs that never ran) past the policy
            # the shard's telemetry is on disk before its commit: a driver killed after the commit loses none
            # of it (killed between the two, the shard runs again and both attempts' rows stay)
            self.sink.flush_telemetry()
            self.sink.commit(job.shard.shard_id, model, task, job.shard.index, scored, job.attempt, extra)
            self.clock.mark("last_result")
            self.metrics.committed(model, task, entry.telemetry)
            self.progress.add(job.shard.n_samples, job.shard.shard_id)
            if extra and extra.get("errors"):
                self.progress.log(f"[raysweep] shard {job.shard.shard_id} FAILED: {extra['errors'][0]}")

    def _add_shard_telemetry(self, job: Job, telemetry: dict) -> None:
        """A shard's (or a bisected shard's part's) telemetry row, its GPU readings and engine starts."""
        for start in telemetry.pop("engine_starts"):
            self.add_engine_row(start)
        for switch in telemetry.pop("switches", []):  # a pool replica's model switch (sleep and wake)
            self.sink.add_telemetry("switches", dict(switch, sweep_model=job.shard.model))
        self._first_token(telemetry)
        for sample in telemetry.pop("gpu_samples"):
            self.sink.add_telemetry("gpu", sample)
            self.metrics.gpu_reading(job.shard.model, sample)
        if job.piece is not None:
            telemetry["piece"] = job.piece.rows
        self.sink.add_telemetry("shards", telemetry)

    def _first_token(self, telemetry: dict) -> None:
        """The earliest first token seen on an engine is its start's first_token_s: kept as an update of the
        row already on disk (cluster/store/telemetry_store.py folds it in), on disk with the shard's telemetry."""
        first = telemetry.pop("first_token_at")
        key = (telemetry["actor_id"], telemetry.pop("engine_start_index"))
        row = self.engine_rows.get(key)
        if first is not None and row is not None and row.get("ready_at") is not None:
            seconds = max(0.0, (first - row["ready_at"]).total_seconds())
            if row["first_token_s"] is None or seconds < row["first_token_s"]:
                row["first_token_s"] = seconds
                self.sink.add_telemetry(FIRST_TOKENS, {"actor_id": key[0], "start_index": key[1],
                                                       "first_token_s": seconds})

    def on_attempt_failed(self, job: Job, error: str) -> None:
        self.metrics.returned(job.shard.model, job.task.name)
        self.metrics.attempt_failed(job.shard.model, job.task.name)
        row = {"shard_id": job.shard.shard_id, "model": job.shard.model, "task": job.task.name,
               "attempt": job.attempt, "error": error}
        self.sink.add_telemetry("shards", row if job.piece is None else dict(row, piece=job.piece.rows))
        if job.piece is None:
            self.progress.log(f"[raysweep] shard {job.shard.shard_id} attempt {job.attempt} failed: {error}")

    def on_bisecting(self, job: Job) -> None:
        self.progress.log(f"[raysweep] shard {job.shard.shard_id} raised on {job.attempt} attempt(s): bisecting its "
                          f"{job.shard.n_samples} rows to run those that can and find those that fail")

    def on_split(self, job: Job, table: pa.Table) -> None:
        """A shard cut in parts at its model's tail (cluster/schedule/tail_split.py): committed as the shard, once."""
        self._commit_parts(job, table, {})

    def on_bisected(self, job: Job, table: pa.Table, row_errors: dict) -> None:
        """A bisected shard: its parts' results and its error rows, committed as the shard, once."""
        self._commit_parts(job, table, row_errors)
        shard = job.shard
        listed = "; ".join(f"sample {sid}: {error}" for sid, error in list(row_errors.items())[:3])
        self.progress.log(f"[raysweep] shard {shard.shard_id}: " + (
            f"{len(row_errors)} row(s) fail alone and are error rows ({listed}); its other "
            f"{table.num_rows - len(row_errors)} rows ran" if row_errors else "every part ran: no row fails alone"))

    def _commit_parts(self, job: Job, table: pa.Table, row_errors: dict) -> None:
        """A shard put together from its parts goes to the scorer as any shard does (committed by
        commit_scored, the scheduler not waiting on its programs), with its manifest extras."""
        shard = job.shard
        excess = row_error_excess(job.task, table)  # its error rows judged by the task's fail_on_error
        # counted once, as the shard, under the actor of its last part that ran; tok/s is not one shard's run here
        tokens = sum(filter(None, table["output_tokens"].to_pylist()))
        telemetry = {"actor_id": self.part_actors.pop(shard.shard_id), "output_tokens": tokens,
                     "n_samples": table.num_rows, "output_tok_per_s": None}
        extra = {"row_errors": row_errors, **({"errors": [excess]} if excess else {})}
        self.submit(job, telemetry, table, extra)
        self.commit_scored()

    def on_failed(self, job: Job) -> None:
        self.part_actors.pop(job.shard.shard_id, None)
        self.metrics.shard_failed(job.shard.model, job.task.name)
        self.sink.fail(job.shard.shard_id, job.errors)
        self.progress.log(f"[raysweep] shard {job.shard.shard_id} FAILED after {job.attempt} attempt(s): "
                          f"{job.errors[-1]}")


def row_error_excess(task, table: pa.Table) -> str | None:
    """Why a committed shard's row errors fail the sweep under the task's `fail_on_error`, or None. Counted
    as actors/evaluator.py `_generate` counts them: rows that raised, out of the rows sent to the engine."""
    statuses, errors = table["status"].to_pylist(), table["error"].to_pylist()
    sample_ids = table["sample_id"].to_pylist()
    sent = [(sid, e) for sid, s, e in zip(sample_ids, statuses, errors) if s != RowStatus.SKIPPED and e != EMPTY_PROMPT]
    failed = [(sid, e) for sid, e in sent if e is not None]
    policy = task.fail_on_error
    allowed = 0 if policy is True else len(sent) if policy is False else policy * len(sent)
    if len(failed) <= allowed:
        return None
    return (f"{len(failed)} of {len(sent)} rows failed, more than fail_on_error={policy} allows; first: sample "
            f"{failed[0][0]}: {failed[0][1]}. They are committed as error rows with the others' results: a "
            "re-run keeps them; fix the rows or the task's fail_on_error, then --new-run")
