"""One sweep, end to end, on a Ray cluster that is already connected (jobs/ calls ray.init):

1. preflight: resolve every model, load its tokenizer, load and check every task's data and
   structured spec, plan shards (prompts measured in tokens) — all before any actor is started;
2. open the output: committed shards of an earlier run of the same spec are skipped;
3. per model: start its actors, fan its shards out, score and commit each result as it arrives;
4. write telemetry and the summary; report failed shards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import ray

from cluster.builtin_model import resolve_model_path
from cluster.data import TaskData, load_task
from cluster.metrics import SweepMetrics
from cluster.placement import actor_resources, requested_capacity
from cluster.planner import TaskPlan, plan_task
from cluster.progress import make_progress
from cluster.scheduler import Job, SchedulerEvents, ShardScheduler
from cluster.scoring import scorer_for
from cluster.sink import ResultSink
from cluster.spec import ModelSpec, SweepSpec
from cluster.staging import StagingFolder
from cluster.structured import check as check_structured
from cluster.structured import is_valid
from cluster.token_cache import TokenCache

MIN_SHARDS_IN_FLIGHT, MAX_SHARDS_IN_FLIGHT = 2, 8


def shards_in_flight(spec: SweepSpec, model: ModelSpec) -> int:
    """Shards each actor holds at once: enough that four times the engine's batch (max_num_seqs) is
    queued, so a streaming engine stays full while each shard waits on its slowest request; at least two.
    Measured on an H100 with an 8B-shape model, 256-sample shards (bench/h100-2026-11-22.md): 2 in
    flight ran at 93% of one 2,048-request batch, 3 at 96%, 4 at 99%; whole sweeps with 8 were no faster
    than with 4 (bench/h100-2026-11-22-s4.md). `actors.shards_in_flight` overrides it."""
    from actors.vllm_engine import DEFAULT_MAX_SEQS

    if spec.actors.shards_in_flight is not None:
        return spec.actors.shards_in_flight
    batch = model.engine.get("max_num_seqs", DEFAULT_MAX_SEQS)
    wanted = -(-4 * batch // spec.shards.max_samples)
    return max(MIN_SHARDS_IN_FLIGHT, min(MAX_SHARDS_IN_FLIGHT, wanted))


class PreflightFailure(ValueError):
    """Raised before any actor starts; the message names the model, task, file or field."""


@dataclass
class ModelPlan:
    model: ModelSpec
    path: str  # resolved local path (builtin models built)
    tasks: list[TaskPlan]


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


def preflight(spec: SweepSpec, strict: bool = True) -> list[ModelPlan]:
    """Everything that can be checked before an actor starts. `strict=False` (for `raysweep plan`)
    counts prompts over the length limit instead of refusing them."""
    data: list[TaskData] = []
    for task in spec.tasks:
        if task.structured is not None:
            try:
                check_structured(task.structured)
            except ValueError as e:
                raise PreflightFailure(f"{spec.source}: tasks.{task.name}.structured.{e}") from None
        data.append(load_task(spec, task))
    plans = []
    staging = StagingFolder()  # rendered prompts on local disk until their shards are dispatched
    for model in spec.models:
        path, tokenizer, max_len = _load_model_meta(model)
        _compile_for(model, tokenizer, spec)
        cache = TokenCache(tokenizer)
        plans.append(ModelPlan(model, path, [plan_task(model, d, tokenizer, max_len, spec.shards, cache, strict,
                                                       staging) for d in data]))
    return plans


def _compile_for(model: ModelSpec, tokenizer, spec: SweepSpec) -> None:
    """Compile each structured spec once against this model's tokenizer, as the engines will."""
    structured = [t for t in spec.tasks if t.structured is not None]
    if not structured:
        return
    import xgrammar as xgr

    from cluster.structured import to_grammar

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer), max_threads=1)
    for task in structured:
        try:
            compiler.compile_grammar(to_grammar(task.structured))
        except Exception as e:  # xgrammar's own error types; the message is what matters
            raise PreflightFailure(f"task {task.name}: structured output does not compile for model "
                                   f"{model.name}: {str(e).strip().splitlines()[-1]}") from None


def _load_model_meta(model: ModelSpec):
    from transformers import AutoConfig, AutoTokenizer

    try:
        path = resolve_model_path(model.path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # OSError, ValueError, hub errors: all mean "this model cannot be loaded"
        raise PreflightFailure(f"model {model.name}: cannot load {model.path!r}: {str(e).splitlines()[0]}") from None
    max_len = model.engine.get("max_model_len") or getattr(config, "max_position_embeddings", None)
    return path, tokenizer, max_len


@dataclass
class Prepared:
    """A sweep that passed preflight, with its output opened and locked; no Ray needed to get here."""
    spec: SweepSpec
    plans: list[ModelPlan]
    sink: ResultSink
    output: str


def prepare(spec: SweepSpec, output: str | None = None, new_run: bool = False) -> Prepared:
    plans = preflight(spec)
    out = output or spec.output
    return Prepared(spec, plans, ResultSink(out, spec, new_run=new_run), out)


def execute(prepared: Prepared, log: Callable[[str], None] = print, max_attempts: int = 3,
            progress_bar: bool | None = None) -> SweepReport:
    """Run what is not committed yet on the connected Ray cluster; releases the output's lock.
    `progress_bar`: a bar (True), log lines (False), or a bar only when stdout is a terminal (None)."""
    started = time.perf_counter()
    spec, plans, sink = prepared.spec, prepared.plans, prepared.sink
    with sink:
        done = sink.committed()
        all_ids = [s.shard_id for mp in plans for tp in mp.tasks for s in tp.shards]
        sink.plan(all_ids)
        report = SweepReport(output=prepared.output, summary=pa.table({}), shards_skipped=len(done & set(all_ids)))
        if report.shards_skipped:
            log(f"[raysweep] resuming: {report.shards_skipped} of {len(all_ids)} shards already committed")
        progress = make_progress(sum(s.n_samples for mp in plans for tp in mp.tasks for s in tp.shards
                                     if s.shard_id not in done), log, progress_bar)
        metrics = SweepMetrics(spec.name)
        try:
            for mp in plans:
                jobs = [Job(s, tp.task) for tp in mp.tasks for s in tp.shards if s.shard_id not in done]
                if jobs:
                    _run_model(spec, mp, jobs, sink, progress, metrics, max_attempts)
                    report.shards_run += len(jobs)
        finally:  # what was measured before a failure is kept
            progress.close()
            metrics.close()
            report.summary = sink.finish()
        report.failed = sink.failed()
        report.gpu_samples = sink.gpu_samples
    report.samples, report.wall_s = progress.done, time.perf_counter() - started
    return report


def run_sweep(spec: SweepSpec, output: str | None = None, log: Callable[[str], None] = print,
              max_attempts: int = 3, new_run: bool = False) -> SweepReport:
    return execute(prepare(spec, output, new_run), log=log, max_attempts=max_attempts)


def _run_model(spec: SweepSpec, mp: ModelPlan, jobs: list[Job], sink: ResultSink, progress,
               metrics: SweepMetrics, max_attempts: int) -> None:
    from actors.evaluator import EvalActor

    resources = actor_resources(spec.actors, ray.cluster_resources())
    remote = ray.remote(EvalActor)
    namespace = f"raysweep-{spec.name}"

    depth = shards_in_flight(spec, mp.model)

    def spawn(n: int):
        # max_concurrency = shards in flight per actor: a streaming engine admits the next one early
        return remote.options(name=f"raysweep:{spec.name}:{mp.model.name}:{n}", namespace=namespace,
                              max_restarts=0, max_concurrency=depth, **resources.options()).remote(
            mp.model, mp.path, resources.num_cpus, resources.num_gpus)

    model = mp.model.name

    def on_result(job: Job, table: pa.Table, telemetry: dict) -> None:
        metrics.returned(model, job.task.name)
        scored = _score(spec, mp.model, job, table)
        sink.commit(job.shard.shard_id, model, job.task.name, job.shard.index, scored, job.attempt)
        for start in telemetry.pop("engine_starts"):
            sink.add_telemetry("actors", start)
        for sample in telemetry.pop("gpu_samples"):
            sink.add_telemetry("gpu", sample)
            metrics.gpu_reading(model, sample)
        sink.add_telemetry("shards", telemetry)
        metrics.committed(model, job.task.name, telemetry)
        progress.add(job.shard.n_samples, job.shard.shard_id)

    def on_attempt_failed(job: Job, error: str) -> None:
        metrics.returned(model, job.task.name)
        metrics.attempt_failed(model, job.task.name)
        sink.add_telemetry("shards", {"shard_id": job.shard.shard_id, "attempt": job.attempt, "error": error})
        progress.log(f"[raysweep] shard {job.shard.shard_id} attempt {job.attempt} failed: {error}")

    def on_failed(job: Job) -> None:
        metrics.shard_failed(model, job.task.name)
        sink.fail(job.shard.shard_id, job.errors)
        progress.log(f"[raysweep] shard {job.shard.shard_id} FAILED after {job.attempt} attempts")

    events = SchedulerEvents(on_result=on_result, on_failed=on_failed, on_attempt_failed=on_attempt_failed,
                             on_actor_started=lambda row: row and sink.add_telemetry("actors", row),
                             on_dispatched=lambda job: metrics.dispatched(model, job.task.name))
    n_actors = min(spec.actors.count, len(jobs))
    with requested_capacity(resources, n_actors):
        ShardScheduler(spawn, n_actors, events, max_attempts=max_attempts, depth=depth,
                       start_one_by_one=0 < resources.num_gpus < 1).run(jobs)


def _score(spec: SweepSpec, model: ModelSpec, job: Job, table: pa.Table) -> pa.Table:
    """Add the driver-side columns: identity, prompt tokens, target, structured validity, score."""
    task, shard = job.task, job.shard
    scorer = scorer_for(task)
    outputs, statuses = table["output_text"].to_pylist(), table["status"].to_pylist()
    targets = shard.targets() if task.target else [None] * table.num_rows  # read from the staged rows
    generated = [s in ("ok", "truncated") and o is not None for o, s in zip(outputs, statuses)]
    valid = [is_valid(task.structured, o) if g and task.structured else None for o, g in zip(outputs, generated)]
    scores = [scorer(o, t) if g and scorer else None for o, t, g in zip(outputs, targets, generated)]
    n = table.num_rows
    # model and task are dictionary-encoded: the type readers infer from the model=/task= directories,
    # so pyarrow, pandas and DuckDB read the results folder as one table without a type clash
    return table.add_column(0, "sweep", pa.array([spec.name] * n)) \
        .add_column(1, "model", pa.array([model.name] * n).dictionary_encode()) \
        .add_column(2, "task", pa.array([task.name] * n).dictionary_encode()) \
        .add_column(4, "shard_id", pa.array([shard.shard_id] * n)) \
        .append_column("prompt_tokens", pa.array(shard.prompt_tokens, pa.int32())) \
        .append_column("structured", pa.array([task.structured.kind if task.structured else None] * n, pa.string())) \
        .append_column("structured_valid", pa.array(valid, pa.bool_())) \
        .append_column("target", pa.array([None if t is None else t if isinstance(t, str) else _json(t)
                                           for t in targets], pa.string())) \
        .append_column("score", pa.array(scores, pa.float64()))


def _json(value) -> str:
    import json

    return json.dumps(value, sort_keys=True)
