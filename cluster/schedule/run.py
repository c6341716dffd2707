"""One sweep, end to end, on a Ray cluster that is connected (jobs/ calls ray.init), or still starting:

1. preflight and planning (cluster/inputs/checks.py): checks first, then each task's plan as it is made;
2. the output is opened: committed shards of an earlier run of the same spec are skipped;
3. one scheduler over every model (cluster/schedule/scheduler.py) starts actors once the models are checked,
   gives them models, and fans each task's shards out as soon as it is planned; each result is
   scored and committed as it arrives (cluster/schedule/commit.py);
4. telemetry, the run's timeline (manifest `runs`) and the summary are written; failures reported.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import ray

from cluster.schedule.commit import Commits
from cluster.schedule.metrics import SweepMetrics
from cluster.contracts.engine_defaults import shared_starts_together
from cluster.contracts.engine_host import EngineHostAddress
from cluster.contracts.errors import RaysweepError
from cluster.plan.engines_per_gpu import choose, generation_budget, resolved
from cluster.plan.placement import capacity, model_resources, requested_capacity
from cluster.plan.planner import TaskPlan
from cluster.plan.plan_source import ModelReady, PlanSource
from cluster.schedule.progress import make_progress
from cluster.score.shard_scoring import replay_table
from cluster.schedule.kept import KeptActors
from cluster.schedule.scheduler import SweepScheduler
from cluster.schedule.work import Job, ModelWork, SchedulerEvents
from cluster.store.manifest import as_made
from cluster.store.output_files import OutputWriteError
from cluster.store.sink import ResultSink
from cluster.contracts.spec import SweepSpec
from cluster.contracts.timing import RunClock
from cluster.plan.depth import MIN_SHARDS_IN_FLIGHT, runs_on_cpu, shards_in_flight

TICK_EVERY_S = 1.0  # progress is told what the sweep is doing at most this often


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


class SweepNameTaken(RaysweepError, RuntimeError):
    """Another sweep of the same name runs on this cluster now: its actors hold the names (and the dashboard's
    labels) this one would take."""

    def __init__(self, name: str):
        super().__init__(f"a sweep named {name!r} is running on this cluster now (its actors are named "
                         f"raysweep:{name}:N); wait for it, or give this sweep another `name:`")


@dataclass
class Prepared:
    """A sweep with its output opened and locked, and its plans coming (or made); no Ray needed here."""
    spec: SweepSpec
    plans: PlanSource
    sink: ResultSink
    output: str
    new_tokens: int | None = None  # the most new tokens the sweep asks of each model (engines_per_gpu.generation_budget)
    rows: int | None = None  # the rows each model runs (its tasks' rows; replayed tasks run none)


def prepare(spec: SweepSpec, output: str | None = None, new_run: bool = False, background: bool = False,
            data: list | None = None) -> Prepared:
    """`background=False`: every check and plan made now, so any bad input raises here. `True`: the
    output is opened now, and planning runs on a thread from `execute` on, while the actors start. `data`: the task
    data `check_inputs` already checked (not read again). `output` defaults to the spec's, from its folder."""
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.data import checked_hashes

    data = check_inputs(spec) if data is None else data  # one read checks each file; its hash goes in the manifest
    out = output or spec.output_path()
    sink = ResultSink(out, spec, new_run=new_run, data_hashes=checked_hashes(data))  # an lm-eval task's documents too
    try:
        spec = as_made(spec, sink.manifest)  # an output made before a setting existed goes on as it was made
        plans = PlanSource(spec, background=background, data=data)
    except BaseException:
        sink.close()
        raise
    return Prepared(spec, plans, sink, out, generation_budget(data), sum(d.n_rows for d in data if d.task.replay is None))


def execute(prepared: Prepared, log: Callable[[str], None] = print, max_attempts: int = 3,
            progress_bar: bool | None = None, clock: RunClock | None = None, kept: KeptActors | None = None,
            engine_host: EngineHostAddress | None = None) -> SweepReport:
    """Run what is not committed yet on the connected Ray cluster; releases the output's lock.
    `progress_bar`: a bar (True), log lines (False), or a bar only when stdout is a terminal (None).
    `kept`: actors whose engines run on after the sweep, and that a later sweep of the same model runs on
    (cluster/schedule/kept.py); the caller closes them. `engine_host`: a local run's engine host
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
                engines = {"engines": run.engines.record()} if run.engines else {}
                sink.add_run({**clock.record(), **run.tail_record(), **engines})
                run.report.summary = sink.finish(_scored(prepared.spec, sink, log))
                for name in sink.set_aside:
                    log(f"[raysweep] {name} could not be read (torn or replaced): set aside as {name}.unreadable-*, "
                        "and this run's telemetry written anew")
                run.record("failed" if sink.failed() else "done", run.report.summary.to_pylist())
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
    return execute(prepare(spec, output, new_run), log=log, max_attempts=max_attempts)


class _Run:
    """One execution: the plans fed to the scheduler, its events into the sink, metrics and progress
    (cluster/schedule/commit.py)."""

    def __init__(self, prepared: Prepared, sink: ResultSink, log, progress_bar, clock: RunClock,
                 kept: KeptActors | None = None, engine_host: EngineHostAddress | None = None):
        self.spec, self.plans, self.sink, self.log, self.clock = prepared.spec, prepared.plans, sink, log, clock
        self.kept = kept
        self.engine_host = engine_host
        self.new_tokens, self.rows = prepared.new_tokens, prepared.rows
        self.done = sink.committed()
        self.report = SweepReport(output=prepared.output, summary=pa.table({}))
        self.progress = make_progress(0, log, progress_bar)  # the total grows as tasks are planned
        self.metrics = SweepMetrics(self.spec.name)
        self.models = {m.name: m for m in self.spec.models}
        self.n_shards = 0
        self._ticked = 0.0  # when on_tick last reported
        self.recorder = None  # sends the sweep's state to the engine pool, where the sweep uses one
        self.engines = None  # the actors' count and GPU share, and why (cluster/plan/engines_per_gpu.py)
        self.commits = Commits(self.spec, sink, self.metrics, self.progress, clock)  # results scored, committed

    def schedule(self, max_attempts: int) -> None:
        from cluster.launch import eval_actor_class

        EvalActor = eval_actor_class()
        resources = ray.cluster_resources()
        self.engines = choose(self.spec, resources, new_tokens=self.new_tokens)
        chosen = self.spec.actors.count is None or self.spec.actors.num_gpus is None
        if chosen and (resources.get("GPU") or self.spec.actors.accelerator_type):
            self.log(f"[raysweep] actors: {self.engines.reason}")
        spec = self.spec = resolved(self.spec, self.engines)
        shapes = model_resources(spec.actors, spec.models, resources)  # per model: its actors' shape
        holds = {}  # per shape: how many actors the cluster holds at once; refuses a shape no node can hold
        for shape in dict.fromkeys(shapes.values()):
            holds[shape] = capacity(shape, [name for name, s in shapes.items() if s == shape])
        cpu = {m.name: runs_on_cpu(m, resources, spec.actors.accelerator_type) for m in spec.models}
        depth = max((shards_in_flight(spec, m, cpu[m.name], self.rows, spec.actors.count) for m in spec.models),
                    default=MIN_SHARDS_IN_FLIGHT)
        remote = ray.remote(EvalActor)
        backends = tuple(sorted({m.backend for m in spec.models}))

        namespace = f"raysweep-{spec.name}"
        if any(a.get("namespace") == namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            raise SweepNameTaken(spec.name)

        def spawn(n: int, requested_at: float, shape):
            # max_concurrency above the shards in flight: the next shard is admitted early, and
            # start_engine / close calls are never queued behind shards
            try:
                return remote.options(name=f"raysweep:{spec.name}:{n}", namespace=namespace,
                                      max_restarts=0, max_concurrency=depth + 2, **shape.options()).remote(
                    requested_at, shape.num_cpus, shape.num_gpus, backends, False, spec.reproducible, self.engine_host)
            except ray.exceptions.ActorAlreadyExistsError:  # another sweep of this name started meanwhile
                raise SweepNameTaken(spec.name) from None

        commits = self.commits
        events = SchedulerEvents(on_result=commits.on_result, on_failed=commits.on_failed,
                                 on_bisected=commits.on_bisected, on_bisecting=commits.on_bisecting,
                                 on_split=commits.on_split, on_attempt_failed=commits.on_attempt_failed,
                                 on_actor_started=commits.add_engine_row,
                                 on_model_failed=lambda model, error: self.log(
                                     f"[raysweep] model {model}: {error}; its shards fail, the other models go on"),
                                 on_dispatched=lambda job: self.metrics.dispatched(job.shard.model, job.task.name),
                                 on_actor_lost=self.progress.log, on_tick=self.on_tick)
        shared = any(0 < shape.num_gpus < 1 for shape in holds)
        keep = None if self.kept is None else self.kept.keeper(self.models, lambda name: bool(self.scheduler.models[name].failed))
        self.scheduler = SweepScheduler(spawn, events, capacity=holds, max_attempts=max_attempts,
                                        start_one_by_one=shared and not shared_starts_together(), keep=keep)
        # every model from the spec now, so its actors start (process, imports) while the checks run;
        # each gets its engine start only once it passed them (ModelReady, in feed)
        for model in spec.models:
            depth_of = shards_in_flight(spec, model, cpu[model.name], self.rows, spec.actors.count)
            self.scheduler.add_model(ModelWork(model.name, spec.actors.count, depth_of,
                                               shape=shapes[model.name]))
        pooled = self._use_kept(spec) or self._use_pool()  # engines already up: their models' shards go to them
        wanted: dict = {}
        for model in spec.models:
            if model.name not in pooled:
                wanted[shapes[model.name]] = wanted.get(shapes[model.name], 0) + spec.actors.count
        wanted = {shape: n if holds[shape] is None else min(n, holds[shape]) for shape, n in wanted.items()}
        try:
            with requested_capacity(wanted):
                self.scheduler.run(self.feed)
            self.commits.commit_scored(wait=True)
        finally:
            self.commits.close()
        self.report.model_changes = self.scheduler.model_changes
        tail = self.tail_record()
        if tail["tail_idle_share"] is not None:
            unit = "GPU-seconds" if any(shape.num_gpus for shape in holds) else "actor-seconds"
            self.log(f"[raysweep] tail: actors idle {tail['tail_idle_share']:.1%} of their {unit} "
                     f"({tail['tail_idle_gpu_s']:.1f}) while others finished; {tail['tail_splits']} shard(s) cut at "
                     "their model's tail")
        if self.scheduler.pool_lost:
            self.log(f"[raysweep] the engine pool went away during the sweep: model(s) "
                     f"{', '.join(self.scheduler.pool_lost)} went on with the sweep's own actors")

    def tail_record(self) -> dict:
        """How long actors idled at the run's tail (cluster/schedule/tail_split.py), kept in the run's record."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is None:
            return {"tail_idle_gpu_s": None, "tail_idle_share": None, "tail_splits": 0}
        self.report.tail = {**scheduler.tail.record(), "tail_splits": scheduler.tail_splits}
        return self.report.tail

    def _use_kept(self, spec: SweepSpec) -> dict:
        """The models whose engines an earlier sweep of this process kept running (cluster/schedule/kept.py):
        their shards go to those actors, as to a pool."""
        running = {m.name: self.kept.running(m) for m in spec.models} if self.kept is not None else {}
        for name, handles in running.items():
            for handle in handles:
                self.scheduler.add_pool(name, handle, shards_in_flight(spec, self.models[name]))
        found = {name: handles for name, handles in running.items() if handles}
        if found:
            self.progress.log(f"[raysweep] engines kept from this process's last sweep run model(s) {', '.join(found)}: "
                              "their shards go to them")
        return found

    def _use_pool(self) -> dict:
        """The sweep's models that the cluster's engine pool serves with the same path and engine arguments
        (cluster/pool/serve_app.py); their shards go to the pool through a client actor of this sweep's.
        The client is started first and reads the pool itself, so Serve is imported in its process, not
        here, while planning goes on; a sweep whose models the pool does not serve removes it at once."""
        from cluster.pool.served import pool_running

        if not pool_running():
            return {}
        from cluster.inputs.builtin_model import resolve_model_path
        from cluster.contracts.pool_protocol import CLIENT_NAMESPACE, QUEUED_PER_SLOT
        from cluster.pool.client import PoolClient, PoolHandle, SweepRecorder, client_name
        from cluster.pool.served import find_pool

        name = client_name(self.spec.name)  # the replicas take turns between sweeps by this name
        client = ray.remote(PoolClient).options(name=name, namespace=CLIENT_NAMESPACE, num_cpus=0,
                                                max_concurrency=1000).remote(name)
        try:
            served, said = ray.get(client.pool.remote(), timeout=120)
        except Exception as e:  # the client could not start or read the pool: the sweep's own actors run it
            served, said = {}, [f"[raysweep] the engine pool could not be read ({type(e).__name__}: "
                                f"{(str(e).strip().splitlines() or [''])[-1][:200]}): the sweep runs on its own actors"]
        for line in said:
            self.progress.log(line)
        paths = {m.name: resolve_model_path(self.spec.model_path(m)) for m in self.spec.models}
        found = find_pool(self.spec, paths, served, self.progress.log)
        if not found:
            ray.kill(client)
            return found
        for model, pooled in found.items():
            # every replica's engine full and as many shards waiting at it, where turns are taken
            # between sweeps and Serve sees the queue it scales on; a replica that switches between models
            # gets all it accepts (QUEUED_PER_SLOT per slot), so that the awake model's next shard is waiting
            # before its last one ends and the replica does not switch away and back (actors/shard_gate.py)
            waiting = QUEUED_PER_SLOT if pooled.switching else 2
            self.scheduler.add_pool(model, PoolHandle(client, pooled), waiting * pooled.depth * pooled.max_replicas,
                                    pooled.max_replicas)
        self.progress.log(f"[raysweep] pool serves model(s) {', '.join(found)}: their shards go to it")
        self.recorder = SweepRecorder(self.spec.name, client)
        return found

    def record(self, state: str, summary: list | None = None) -> None:
        """The sweep's state, for the pool's HTTP API (only where the sweep uses a pool)."""
        if self.recorder is None:
            return
        failed = self.sink.failed()
        output = self.report.output  # the ingress (another process, maybe another node) needs it whole
        output = output if "://" in output else os.path.abspath(output)
        self.recorder.record({"state": state, "output": output, "samples_done": self.progress.done,
                              "samples_total": self.progress.total, "shards_total": self.n_shards,
                              "shards_committed": len(self.sink.committed()), "shards_failed": len(failed),
                              "failures": {sid: e["errors"][-1] for sid, e in failed.items() if e.get("errors")},
                              "summary": summary}, final=summary is not None)

    def feed(self, timeout_s: float) -> bool:
        """Hand what planning produced to the scheduler; True once planning is over."""
        for event in self.plans.take(timeout_s):
            if isinstance(event, ModelReady):
                model, path = event.model, event.path
                self.scheduler.models[model.name].start = (
                    lambda handle, at, model=model, path=path: handle.start_engine.remote(model, path, at))
            else:
                self.add_plan(event)
        if self.plans.done:
            self.clock.marks.setdefault("planning", self.plans.finished_at)
            if self.report.shards_skipped:
                widened = self.sink.widened
                self.log(f"[raysweep] resuming: {self.report.shards_skipped} of {self.n_shards} shards "
                         "already committed" + (f"; {widened} of their files, written by an earlier raysweep, "
                                                "now hold this one's columns (null where they had none)"
                                                if widened else ""))
        return self.plans.done

    def add_plan(self, plan: TaskPlan) -> None:
        ids = [s.shard_id for s in plan.shards]
        if plan.task.replay is not None:
            self.add_replay(plan, ids)
            return
        self.progress.log(f"[raysweep] planned {plan.model.name}/{plan.task.name}: {len(plan.lengths)} samples in "
                          f"{len(ids)} shard(s)")
        self.sink.plan(ids)
        self.n_shards += len(ids)
        jobs = [Job(s, plan.task) for s in plan.shards if s.shard_id not in self.done]
        self.report.shards_skipped += len(ids) - len(jobs)
        self.report.shards_run += len(jobs)
        self.progress.grow(sum(job.shard.n_samples for job in jobs))
        self.scheduler.add_jobs(jobs)

    def add_replay(self, plan: TaskPlan, ids: list[str]) -> None:
        """A replay task's shards are scored and committed from the data here: no actor, no engine."""
        self.progress.log(f"[raysweep] replaying {plan.task.name} as model {plan.model.name}: "
                          f"{len(plan.lengths)} samples in {len(ids)} shard(s), no engine")
        self.sink.plan(ids)
        self.n_shards += len(ids)
        shards = [s for s in plan.shards if s.shard_id not in self.done]
        self.report.shards_skipped += len(ids) - len(shards)
        self.report.shards_run += len(shards)
        self.progress.grow(sum(s.n_samples for s in shards))
        for shard in shards:
            table = replay_table(shard)
            telemetry = {"actor_id": "driver", "n_samples": shard.n_samples, "output_tokens": 0,
                         "output_tok_per_s": None}  # for the Ray metrics: nothing ran
            self.commits.submit(Job(shard, plan.task), telemetry, table)
        self.commits.commit_scored()

    def on_tick(self, scheduler: SweepScheduler) -> None:
        """Between results: shards whose scoring finished are committed; what the sweep is doing, for the
        progress line (once a second at most: the scheduler's loop turns every 50 ms while planning, and
        once per result)."""
        self.commits.commit_scored()
        now = time.perf_counter()
        if now - self._ticked < TICK_EVERY_S:
            return
        self._ticked = now
        counts = scheduler.state_counts()
        doing = ", ".join(f"{n} actor(s) {state}" for state, n in sorted(counts.items()) if n) or "no actors yet"
        in_flight = sum(kind == "shard" for kind, _, _ in scheduler.inflight.values())
        self.progress.tick(f"{doing}; {in_flight} shard(s) in flight" + ("; planning" if not self.plans.done else ""))
        self.record("running")
