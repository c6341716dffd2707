"""One sweep, end to end, on a Ray cluster that is connected (jobs/ calls ray.init), or still starting:

1. preflight and planning (cluster/inputs/checks.py): checks first, then each task's plan as it is made;
2. the output is opened: committed shards of an earlier run of the same spec are skipped;
3. the fleet is sized (cluster/schedule/fleet_size.py) and one scheduler over every model
   (cluster/schedule/scheduler.py) starts its actors (cluster/schedule/fleet.py), gives them models once they
   are checked, or sends a model's shards to engines already up (cluster/schedule/routing.py), and fans each
   task's shards out as soon as it is planned (cluster/schedule/plan_feed.py); each result is scored and
   committed as it arrives (cluster/schedule/commit.py), and progress told meanwhile (cluster/schedule/progress.py);
4. telemetry, the run's timeline (manifest `runs`) and the summary are written; failures reported.
"""

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
from cluster.plan.placement import requested_capacity
from cluster.plan.plan_source import PlanSource
from cluster.schedule.commit import Commits
from cluster.schedule.fleet import KeptActors
from cluster.schedule.fleet_size import FleetSize, size_fleet
from cluster.schedule.plan_feed import PlanFeed
from cluster.schedule.progress import SweepMetrics, Ticks, make_progress
from cluster.schedule.routing import PoolStatus, pool_lost_line, route
from cluster.schedule.scheduler import SweepScheduler
from cluster.schedule.tail_split import tail_line
from cluster.schedule.work import SchedulerEvents
from cluster.store.manifest import as_made
from cluster.store.output_files import OutputWriteError
from cluster.store.sink import ResultSink


@dataclass
class SweepReport:
    output: str
    summary: pa.Table
    failed: dict = field(default_factory=dict)  # shard_id -> manifest entry with errors
    wall_s: float = 0.0
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
    plans: PlanSource
    sink: ResultSink
    output: str
    new_tokens: int | None = None  # the most new tokens asked of each model (cluster/inputs/data.py generation_budget)
    rows: int | None = None  # the rows each model runs (its tasks' rows; replayed tasks run none)


def prepare(spec: SweepSpec, data: list, output: str | None = None, new_run: bool = False,
            background: bool = False) -> Prepared:
    """`data`: the task data `check_inputs` returned (each file read once; not read again here).
    `background=False`: every plan made now, so any bad input raises here. `True`: the output is opened now,
    and planning runs on a thread from `execute` on, while the actors start. `output` defaults to the spec's,
    from its folder."""
    from cluster.inputs.data import checked_hashes, generation_budget

    out = output or spec.output_path()
    sink = ResultSink(out, spec, new_run=new_run, data_hashes=checked_hashes(data))  # an lm-eval task's documents too
    try:
        spec = as_made(spec, sink.manifest)  # an output made before a setting existed goes on as it was made
        plans = PlanSource(spec, data, background=background)
    except BaseException:
        sink.close()
        raise
    rows = sum(d.n_rows for d in data if d.task.replay is None)
    return Prepared(spec, plans, sink, out, generation_budget(data), rows)


def execute(prepared: Prepared, log: Callable[[str], None] = print, max_attempts: int = 3,
            progress_bar: bool | None = None, clock: RunClock | None = None, kept: KeptActors | None = None,
            engine_host: EngineHostAddress | None = None) -> SweepReport:
    """Run what is not committed yet on the connected Ray cluster; releases the output's lock.
    `progress_bar`: a bar (True), log lines (False), or a bar only when stdout is a terminal (None).
    `kept`: actors whose engines run on after the sweep, and that a later sweep of the same model runs on
    (`KeptActors`, cluster/schedule/fleet.py); the caller closes them. `engine_host`: a local run's engine host
    (cluster/launch.py EngineHost), whose engine processes the actors on its machine use."""
    started = time.perf_counter()
    clock = clock or RunClock(time.time())
    prepared.plans.start()  # a background plan starts now, with Ray up
    if any(t.lm_eval is not None for t in prepared.spec.tasks):
        from cluster.lm_eval.run import score_ahead

        score_ahead()  # lm-eval's scoring pass prepared while the shards run
    with prepared.sink as sink:
        run = _Run(prepared, sink, log, progress_bar, clock, kept, engine_host)
        try:
            run.schedule(max_attempts)
        finally:  # what was measured before a failure is kept
            run.progress.close()
            run.metrics.close()
            if not isinstance(sys.exc_info()[1], OutputWriteError):  # else the output takes nothing more now
                engines = {"engines": run.size.engines.record()} if run.size else {}
                sink.add_run({**clock.record(), **run.tail_record(), **engines})
                run.report.summary = sink.finish(_scored(prepared.spec, sink, log))
                for name in sink.set_aside:
                    log(f"[raysweep] {name} could not be read (torn or replaced): set aside as {name}.unreadable-*, "
                        "and this run's telemetry written anew")
                ended = SweepState.FAILED if sink.failed() else SweepState.DONE
                run.status.record(ended, run.report.summary.to_pylist())
        run.report.failed = sink.failed()
        run.report.gpu_samples = sink.gpu_samples
    run.report.samples, run.report.wall_s = run.progress.done, time.perf_counter() - started
    return run.report


def _scored(spec: SweepSpec, sink, log: Callable[[str], None]):
    """The run's summary, with lm-eval's own scores of its `lm_eval:` tasks (cluster/lm_eval/scores.py)."""
    summary = sink.summary()
    if not any(t.lm_eval is not None for t in spec.tasks):
        return summary
    from cluster.inputs.model_files import chat_tokenizer
    from cluster.lm_eval.scores import scored_summary

    return scored_summary(spec, sink, summary, log, lambda: chat_tokenizer(spec.models, spec.base_dir))


def run_sweep(spec: SweepSpec, output: str | None = None, log: Callable[[str], None] = print,
              max_attempts: int = 3, new_run: bool = False) -> SweepReport:
    from cluster.inputs.checks import check_inputs

    return execute(prepare(spec, check_inputs(spec), output, new_run), log=log, max_attempts=max_attempts)


class _Run:
    """One execution, composed of its parts: the fleet sized (cluster/schedule/fleet_size.py), the scheduler
    (scheduler.py) and the engines already up that it routes models to (routing.py), the plans fed to it
    (plan_feed.py), its events into the sink (commit.py) and progress (progress.py)."""

    def __init__(self, prepared: Prepared, sink: ResultSink, log, progress_bar, clock: RunClock,
                 kept: KeptActors | None = None, engine_host: EngineHostAddress | None = None):
        self.prepared, self.sink, self.log, self.clock = prepared, sink, log, clock
        self.kept, self.engine_host = kept, engine_host
        self.report = SweepReport(output=prepared.output, summary=pa.table({}))
        self.progress = make_progress(0, log, progress_bar)  # the total grows as tasks are planned
        self.metrics = SweepMetrics(prepared.spec.name)
        self.commits = Commits(prepared.spec, sink, self.metrics, self.progress, clock)  # results scored, committed
        self.ticks = Ticks(self.progress)
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
        pooled, self.status.recorder = route(size.spec, self.kept, scheduler.fleet, self.progress.log)
        feed = PlanFeed(prepared.plans, scheduler, self.sink, self.commits, self.progress, self.report, self.clock,
                        self.log)
        try:
            with requested_capacity(size.requested(pooled)):
                scheduler.run(feed)
            self.commits.commit_scored(wait=True)
        finally:
            self.commits.close()
        self.report.model_changes = scheduler.fleet.model_changes
        if (line := tail_line(self.tail_record(), size.unit)) is not None:
            self.log(line)
        if scheduler.fleet.pool_lost:
            self.log(pool_lost_line(scheduler.fleet.pool_lost))

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
