"""One sweep, end to end, on a Ray cluster that is connected (jobs/ calls ray.init), or still starting:

1. preflight and planning (cluster/inputs/checks.py): checks first, then each task's plan as it is made;
2. the output is opened: committed shards of an earlier run of the same spec are skipped (all: no Ray, `_finished`);
3. the fleet is sized (cluster/schedule/fleet_size.py) and one scheduler over every model
   (cluster/schedule/scheduler.py) starts its actors (cluster/schedule/fleet.py), gives them models once they
   are checked, or sends a model's shards to engines already up (cluster/schedule/engine_sources.py), and fans each
   task's shards out as soon as it is planned (`PlanFeed`, below); each result is scored and
   committed as it arrives (cluster/schedule/commit.py), and progress told meanwhile (cluster/schedule/progress.py);
4. telemetry, the run's timeline (manifest `runs`) and the summary are written, whole through a stop signal."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import ray

from cluster.contracts.engine_host import EngineHostAddress
from cluster.contracts.pool_protocol import SweepState
from cluster.contracts.spec import SweepSpec
from cluster.contracts.timing import RunClock
from cluster.contracts.uninterrupted import uninterrupted
from cluster.plan.placement import requested_capacity
from cluster.plan.plan_source import ModelReady, PlanSource, planned_pairs
from cluster.plan.planner import TaskPlan
from cluster.schedule.commit import Commits
from cluster.schedule.ending import complete_summary, samples_of, write_summary
from cluster.schedule.fleet import KeptActors
from cluster.schedule.fleet_size import FleetSize, size_fleet
from cluster.schedule.progress import SweepMetrics, Ticks, make_progress
from cluster.schedule.engine_sources import PoolStatus, engine_sources, lend, pool_replicas
from cluster.schedule.placement_wait import PlacementWatch
from cluster.schedule.scheduler import SweepScheduler
from cluster.schedule.tail_split import tail_line
from cluster.schedule.work import Job, SchedulerEvents
from cluster.score.shard_scoring import replay_table
from cluster.store.manifest import as_made
from cluster.store.output_files import OutputWriteError
from cluster.store.sink import ResultSink


@dataclass
class SweepReport:
    output: str
    summary: pa.Table
    failed: dict = field(default_factory=dict)  # shard_id -> manifest entry with errors
    wall_s: float | None = 0.0  # from Ray up (the scheduler's start) to the last commit; None: nothing left to run
    command_s: float = 0.0  # from the command's start (the clock's) to the same
    samples: int = 0
    gpu_samples: int = 0  # NVML readings in telemetry/gpu.parquet from this run
    shards_run: int = 0
    shards_skipped: int = 0  # committed by an earlier run
    model_changes: int = 0  # actors that went from one model to another
    tail: dict = field(default_factory=dict)  # tail_idle_gpu_s, tail_idle_share, tail_splits (cluster/schedule/tail_split.py)


@dataclass
class Prepared:
    """A sweep with its output opened and locked, and its plans coming (or made); no Ray needed here."""
    spec: SweepSpec
    plans: PlanSource | None  # None where nothing is left to run
    sink: ResultSink
    output: str
    new_tokens: int | None = None  # the most new tokens asked of each model (cluster/inputs/data.py generation_budget)
    rows: int | None = None  # the rows each model runs (its tasks' rows; replayed tasks run none)
    nothing_left: bool = False  # an earlier run committed every shard (cluster/store/sink.py nothing_left)


def prepare(spec: SweepSpec, data: list, output: str | None = None, new_run: bool = False,
            background: bool = False) -> Prepared:
    """`data`: the task data `check_inputs` returned (each file read once; not read again here).
    `background=False`: every plan made now, so any bad input raises here. `True`: the output is opened now,
    and planning runs on a thread from `execute` on, while the actors start (with nothing left to run, none).
    `output` defaults to the spec's, from its folder."""
    from cluster.inputs.data import checked_hashes, generation_budget

    out = output or spec.output_path()
    hashes, new_tokens = checked_hashes(data), generation_budget(data)
    rows = sum(d.n_rows for d in data if d.task.replay is None)
    sink = ResultSink(out, spec, new_run=new_run, data_hashes=hashes)  # an lm-eval task's documents too
    try:
        spec = as_made(spec, sink.manifest)  # an output made before a setting existed goes on as it was made
        nothing_left = sink.nothing_left(planned_pairs(spec))
        plans = None if nothing_left else PlanSource(spec, data, background=background)
    except BaseException:
        sink.close()
        raise
    return Prepared(spec, plans, sink, out, new_tokens, rows, nothing_left)


def execute(prepared: Prepared, log: Callable[[str], None] = print, max_attempts: int = 3,
            progress_bar: bool | None = None, clock: RunClock | None = None, kept: KeptActors | None = None,
            engine_host: EngineHostAddress | None = None,
            fleet_sized: Callable[[FleetSize, frozenset], None] | None = None) -> SweepReport:
    """Run what is not committed yet on the connected Ray cluster (none needed where nothing is); releases the
    output's lock. `progress_bar`: a bar (True), log lines (False), or a bar only when stdout is a terminal (None).
    `kept`: actors whose engines run on after the sweep, and that a later sweep of the same model runs on
    (`KeptActors`, cluster/schedule/fleet.py); the caller closes them. `engine_host`: a local run's engine host
    (cluster/launch.py EngineHost), whose engine processes the actors on its machine use. `fleet_sized(size, lent)`:
    told the fleet's size and the models lent engines, before any actor starts (the early engines' check)."""
    clock = clock or RunClock(time.time())
    if prepared.nothing_left:
        return _finished(prepared, log, clock)
    started = time.perf_counter()
    prepared.plans.start()  # a background plan starts now, with Ray up
    if any(t.lm_eval is not None for t in prepared.spec.tasks):
        from cluster.lm_eval.run import score_ahead

        score_ahead()  # lm-eval's scoring pass prepared while the shards run
    with prepared.sink as sink:
        run = _Run(prepared, sink, log, progress_bar, clock, kept, engine_host, fleet_sized)
        try:
            run.schedule(max_attempts)
        finally:  # what was measured before a failure is kept
            with uninterrupted():
                run.progress.close()
                run.metrics.close()
                if not isinstance(sys.exc_info()[1], OutputWriteError):  # else the output takes nothing more now
                    engines = {"engines": run.size.engines.record()} if run.size else {}
                    sink.add_run({**clock.record(), **run.tail_record(), **engines})
                    run.report.summary = write_summary(prepared.spec, sink, log)
                    ended = SweepState.FAILED if sink.failed() else SweepState.DONE
                    run.status.record(ended, run.report.summary.to_pylist())
        run.report.failed, run.report.gpu_samples = sink.failed(), sink.gpu_samples
    run.report.samples, run.report.wall_s = run.progress.done, time.perf_counter() - started
    run.report.command_s = time.time() - clock.started_at
    return run.report


def _finished(prepared: Prepared, log: Callable[[str], None], clock: RunClock) -> SweepReport:
    """The report of a sweep whose every shard an earlier run committed, from its output (its summary:
    cluster/schedule/ending.py complete_summary), said in one line: no plan, no Ray, no actor."""
    with prepared.sink as sink:
        committed, summary = len(sink.committed()), complete_summary(prepared.spec, sink, log)
        log(f"[raysweep] nothing left to run: all {committed} shard(s) of this sweep, "
            f"{samples_of(prepared.spec, summary)} samples, were committed by an earlier run")
        return SweepReport(output=prepared.output, summary=summary, failed=sink.failed(), wall_s=None,
                           command_s=time.time() - clock.started_at, shards_skipped=committed)


def run_sweep(spec: SweepSpec, output: str | None = None, new_run: bool = False, **options) -> SweepReport:
    """`prepare` (the spec's inputs checked first), then `execute` with `options`: a command's steps in one."""
    from cluster.inputs.checks import check_inputs

    return execute(prepare(spec, check_inputs(spec).data, output, new_run), **options)


class _Run:
    """One execution, composed of its parts: the fleet sized (cluster/schedule/fleet_size.py), the scheduler
    (scheduler.py) and the engines already up that are lent to it (engine_sources.py), the plans fed to it
    (`PlanFeed`), its events into the sink (commit.py) and progress (progress.py)."""

    def __init__(self, prepared: Prepared, sink: ResultSink, log, progress_bar, clock: RunClock,
                 kept: KeptActors | None = None, engine_host: EngineHostAddress | None = None,
                 fleet_sized: Callable[[FleetSize, frozenset], None] | None = None):
        self.prepared, self.sink, self.log, self.clock = prepared, sink, log, clock
        self.kept, self.engine_host, self.fleet_sized = kept, engine_host, fleet_sized
        self.report = SweepReport(output=prepared.output, summary=pa.table({}))
        self.progress = make_progress(0, log, progress_bar)  # the total grows as tasks are planned
        self.metrics = SweepMetrics(prepared.spec.name)
        self.commits = Commits(prepared.spec, sink, self.metrics, self.progress, clock)  # results scored, committed
        self.ticks = Ticks(self.progress, PlacementWatch(prepared.spec.name, self.progress.log, pool=pool_replicas))
        self.status = PoolStatus(sink, self.progress, self.report)  # for the pool's HTTP API, where one is used
        self.size: FleetSize | None = None  # the actors' count, GPU share and shapes, and why
        self.scheduler: SweepScheduler | None = None

    def schedule(self, max_attempts: int) -> None:
        prepared = self.prepared
        size = self.size = size_fleet(prepared.spec, ray.cluster_resources(), prepared.new_tokens, self.log,
                                      prepared.rows)
        scheduler = self.scheduler = SweepScheduler(
            size.spawner(self.engine_host), self._events(), capacity=size.holds, max_attempts=max_attempts,
            start_one_by_one=size.start_one_by_one, keep=self._keep(size.spec))
        # every model from the spec now, so its actors start (process, imports) while the checks run;
        # each gets its engine start only once it passed them (ModelReady, in the feed)
        for work in size.work():
            scheduler.add_model(work)
        lending = lend(size.spec, engine_sources(self.kept), scheduler.fleet, self.progress.log)
        if self.fleet_sized is not None:
            self.fleet_sized(size, lending.models)
        self.status.recorder = lending.recorder
        feed = PlanFeed(prepared.plans, scheduler, self.sink, self.commits, self.progress, self.report, self.clock,
                        self.log)
        try:
            with requested_capacity(size.requested(lending.models)):
                scheduler.run(feed)
            self.commits.commit_scored(wait=True)
        finally:
            self.commits.close()
        self.report.model_changes = scheduler.fleet.model_changes
        self.progress.close()  # the bar's last state on a line of its own: the lines below are not the bar's
        if (line := tail_line(self.tail_record(), size.unit)) is not None:
            self.log(line)
        if scheduler.fleet.lent_lost:
            self.log(lending.gone_line(scheduler.fleet.lent_lost))

    def _events(self) -> SchedulerEvents:
        commits = self.commits
        return SchedulerEvents(on_result=commits.on_result, on_failed=commits.on_failed,
                               on_bisected=commits.on_bisected, on_bisecting=commits.on_bisecting,
                               on_split=commits.on_split, on_attempt_failed=commits.on_attempt_failed,
                               on_actor_started=commits.add_engine_row,
                               on_model_failed=lambda model, error: self.log(
                                   f"[raysweep] model {model}: {error}; its shards fail, the other models go on"),
                               on_dispatched=lambda job: self.metrics.dispatched(job.shard.model, job.task.name),
                               on_actor_lost=self.progress.log, on_tick=self.on_tick)

    def _keep(self, spec: SweepSpec):
        """The scheduler's `keep`: actors whose engines run on after the sweep (cluster/schedule/fleet.py
        `KeptActors`)."""
        if self.kept is None:
            return None
        models = {m.name: m for m in spec.models}
        return self.kept.keeper(models, lambda name: bool(self.scheduler.models[name].failed))

    def on_tick(self, scheduler: SweepScheduler) -> None:
        """Between results: shards whose scoring finished are committed; what the sweep is doing, for the
        progress line and the pool's HTTP API."""
        self.commits.commit_scored()
        planning = not self.prepared.plans.done
        if self.ticks.tick(scheduler.fleet.slots, len(scheduler.inflight.shards()), planning):
            self.status.record(SweepState.RUNNING)

    def tail_record(self) -> dict:
        """How long actors idled at the run's tail (cluster/schedule/tail_split.py), kept in the run's record."""
        if self.scheduler is None:
            return {"tail_idle_gpu_s": None, "tail_idle_share": None, "tail_splits": 0}
        self.report.tail = {**self.scheduler.tail.record(), "tail_splits": self.scheduler.tail_splits}
        return self.report.tail


class PlanFeed:
    """What planning produces (cluster/plan/plan_source.py), into the scheduler as it comes: the scheduler's
    `feed`.

    1. A model that passed its checks (ModelReady) gets its engine start: from here its actors start engines.
    2. A task's plan: its shards are recorded as planned in the output; those an earlier run committed are
       skipped (a resume), the others go to the scheduler at once and count to the progress's total.
    3. A replay task's shards are scored and committed from the data here: no actor, no engine.
    4. Once planning is over: when it ended (the run's clock), and what a resume skipped, said.
    """

    def __init__(self, plans: PlanSource, scheduler: SweepScheduler, sink: ResultSink, commits: Commits, progress,
                 report, clock: RunClock, log: Callable[[str], None]):
        """`report` (SweepReport) counts the shards run and skipped."""
        self.plans, self.scheduler, self.sink, self.commits = plans, scheduler, sink, commits
        self.progress, self.report, self.clock, self.log = progress, report, clock, log
        self.done = sink.committed()  # by an earlier run of the same spec

    def __call__(self, timeout_s: float) -> bool:
        """Hand what planning produced (waiting up to `timeout_s` for it) to the scheduler; True once planning
        is over."""
        for event in self.plans.take(timeout_s):
            if isinstance(event, ModelReady):
                self.scheduler.models[event.model.name].ready(event.model, event.path, event.family)
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
