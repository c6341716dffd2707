"""What planning produces (cluster/plan/plan_source.py), into the scheduler as it comes: the scheduler's `feed`.

1. A model that passed its checks (ModelReady) gets its engine start: from here its actors start engines for it.
2. A task's plan: its shards are recorded as planned in the output; those an earlier run committed are skipped
   (a resume), the others go to the scheduler at once and count to the progress's total.
3. A replay task's shards are scored and committed from the data here: no actor, no engine.
4. Once planning is over: when it ended (the run's clock), and what a resume skipped, said.
"""

from __future__ import annotations

from typing import Callable

from cluster.contracts.timing import RunClock
from cluster.plan.plan_source import ModelReady, PlanSource
from cluster.plan.planner import TaskPlan
from cluster.schedule.commit import Commits
from cluster.schedule.scheduler import SweepScheduler
from cluster.schedule.work import Job
from cluster.score.shard_scoring import replay_table
from cluster.store.sink import ResultSink


class PlanFeed:
    def __init__(self, plans: PlanSource, scheduler: SweepScheduler, sink: ResultSink, commits: Commits, progress,
                 report, clock: RunClock, log: Callable[[str], None]):
        """`report` (cluster/schedule/run.py SweepReport) counts the shards run and skipped."""
        self.plans, self.scheduler, self.sink, self.commits = plans, scheduler, sink, commits
        self.progress, self.report, self.clock, self.log = progress, report, clock, log
        self.done = sink.committed()  # by an earlier run of the same spec

    def __call__(self, timeout_s: float) -> bool:
        """Hand what planning produced (waiting up to `timeout_s` for it) to the scheduler; True once planning
        is over."""
        for event in self.plans.take(timeout_s):
            if isinstance(event, ModelReady):
                model, path = event.model, event.path
                self.scheduler.models[model.name].start = (
                    lambda handle, at, model=model, path=path: handle.start_engine.remote(model, path, at))
            elif event.task.replay is not None:
                self._replay(event)
            else:
                self._add(event)
        if self.plans.done:
            self.clock.marks.setdefault("planning", self.plans.finished_at)
            if self.report.shards_skipped:
                widened = self.sink.widened
                self.log(f"[raysweep] resuming: {self.report.shards_skipped} of "
                         f"{self.report.shards_skipped + self.report.shards_run} shards already committed"
                         + (f"; {widened} of their files, written by an earlier raysweep, now hold this one's "
                            "columns (null where they had none)" if widened else ""))
        return self.plans.done

    def _add(self, plan: TaskPlan) -> None:
        self.progress.log(f"[raysweep] planned {plan.model.name}/{plan.task.name}: {len(plan.lengths)} samples in "
                          f"{len(plan.shards)} shard(s)")
        jobs = [Job(s, plan.task) for s in self._left(plan)]
        self.scheduler.add_jobs(jobs)

    def _replay(self, plan: TaskPlan) -> None:
        """A replay task's shards are scored and committed from the data here: no actor, no engine."""
        self.progress.log(f"[raysweep] replaying {plan.task.name} as model {plan.model.name}: "
                          f"{len(plan.lengths)} samples in {len(plan.shards)} shard(s), no engine")
        for shard in self._left(plan):
            telemetry = {"actor_id": "driver", "n_samples": shard.n_samples, "output_tokens": 0,
                         "output_tok_per_s": None}  # for the Ray metrics: nothing ran
            self.commits.submit(Job(shard, plan.task), telemetry, replay_table(shard))
        self.commits.commit_scored()

    def _left(self, plan: TaskPlan) -> list:
        """The plan's shards recorded as planned; those not committed yet, counted (run, skipped, samples)."""
        ids = [s.shard_id for s in plan.shards]
        self.sink.plan(ids)
        left = [s for s in plan.shards if s.shard_id not in self.done]
        self.report.shards_skipped += len(ids) - len(left)
        self.report.shards_run += len(left)
        self.progress.grow(sum(s.n_samples for s in left))
        return left
