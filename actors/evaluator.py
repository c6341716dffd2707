"""EvalActor: a GPU share that runs one engine at a time (one model, one profile) and turns shards into
result tables.

The class is plain Python; the scheduler wraps it with `ray.remote`, the resources from the spec and
`max_concurrency` above the number of shards it keeps in flight, so a streaming engine admits the next
shard while the last one finishes. The actor is started before its model is chosen (its process and
imports overlap the driver's planning); `start_engine` gives it a model, and a later call another one
(a counted model change). A shard whose profile the engine does not run waits for the shards in
flight, then the engine restarts with that profile (counted, and reported as a new engine start).
Each shard returns its results as an Arrow table and one telemetry row (docs/design.md, Output); figures that are
not measured here are None. With `sleep_mode` (a pool replica serving several models on one GPU share), a
new model's start puts the running engine to sleep instead of closing it, and `switch` wakes it again.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone

import pyarrow as pa

from actors.engine import EngineProfile, runs_profile
from actors.engine_factory import BATCH_INVARIANT, engine_cpu_threads, reproducible_refusal, runs_vllm
from actors.hosted_engine import connect
from actors.local_engine import InProcess
from actors.telemetry import GpuSampler, gpu_name
from actors.weight_swap import BUILD_FIGURES, not_swapped, why_not_swapped
from cluster.contracts.engine_host import EngineHostAddress, engine_key
from cluster.contracts.shard import LONG, NOT_RUN, Shard
from cluster.contracts.results_schema import actor_table
from cluster.contracts.spec import ModelSpec, TaskSpec
from cluster.contracts.timing import process_started_at, since, utc

def shard_profile(shard: Shard) -> EngineProfile:
    return EngineProfile(name=shard.profile, chunked_prefill=shard.profile == LONG,
                         max_num_batched_tokens=shard.max_num_batched_tokens)


class EvalActor:
    """A share of a GPU (or CPUs) that runs one engine at a time. Created before its model is chosen: the
    process starts and imports the engine's libraries (vLLM, torch) while the driver still plans; the
    scheduler then gives it a model with `start_engine`, and may give it another when that model's work
    is done (a counted model change)."""

    def __init__(self, requested_at: float, num_cpus: float = 1, num_gpus: float = 0, backends: tuple = ("auto",),
                 sleep_mode: bool = False, reproducible: bool = False, engine_host: EngineHostAddress | None = None):
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.sleep_mode = sleep_mode  # engines that sleep and wake: one actor switching between models
        self.reproducible = reproducible
        if reproducible:  # before vLLM and its engine-core forkserver start: every engine here reads it
            os.environ[BATCH_INVARIANT] = "1"
        self.actor_id, self.node_ip, self.node_id = _identity()
        self.gpu_ids = _gpu_ids()  # the GPUs Ray gave it (several for an engine across GPUs)
        # Ray may hand over a worker process it started before this actor was asked for: the clock then
        # starts at the request, not at the process's birth
        process_at = max(process_started_at() or requested_at, requested_at)
        self.cpu_threads = engine_cpu_threads(num_cpus, num_gpus, _node_gpus(self.node_id)) if num_gpus else None
        # the engines run in a process forked from the run's engine host, imported before Ray started, where
        # there is one on this machine (a local run's); else here, with the imports every engine start would
        # otherwise pay done now, once. Reproducible runs on vLLM keep their engines here: vLLM's batch-invariant
        # setting is this process's, set above (the CPU engine's is its start's `reproducible`: one row at a time)
        own = reproducible and runs_vllm(backends)
        self.engines = (None if own else connect(engine_host, engine_key(self.gpu_ids))) or InProcess(backends)
        self.gpu_name = gpu_name()
        self.refusal = reproducible_refusal(backends) if reproducible else None  # the driver stops on it
        self.gpu = GpuSampler().start()  # one sampler for the actor's life; shards read their own windows
        self._imported_at = time.time()
        self._first = {"requested_at": requested_at, "process_started_at": utc(process_at),
                       "process_s": since(requested_at, process_at), "imports_s": since(process_at, self._imported_at)}
        self.model = self.model_path = self.engine = None
        self.restarts = self.model_changes = self.engine_starts = 0
        self._cv = threading.Condition()
        self._inflight = 0
        self._starts: list[dict] = []  # profile restarts not yet reported to the driver
        self.asleep: dict[str, tuple] = {}  # model name -> (model, path, engine), sleeping
        self.switches = 0

    def ready(self) -> dict:
        """Returns once the process is up and its imports are done."""
        return {"actor_id": self.actor_id, "node_id": self.node_id, "node_ip": self.node_ip, "refusal": self.refusal,
                **self._first}

    def start_engine(self, model: ModelSpec, model_path: str, requested_at: float,
                     profile: EngineProfile = EngineProfile()) -> dict:
        """Run `model` from now on: another checkpoint of the running engine's model by loading its weights into
        that engine (actors/weight_swap.py), else a new engine (the other model's closed, or, with `sleep_mode`,
        put to sleep for `switch`); returns its telemetry/actors row. Called only while no shard is in flight."""
        with self._cv:
            if self.engine is not None and self.sleep_mode:
                self.engine.sleep()
                self.asleep[self.model.name] = (self.model, self.model_path, self.engine)
                self.engine = None
            elif self.engine is not None and (row := self._swapped(model, model_path, profile, requested_at)):
                return row
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            reason = "model" if self.engine_starts else "first"  # a start that raised does not count
            self.model, self.model_path = model, model_path
            row = self._start_engine(profile, requested_at, reason)
            self.model_changes += reason == "model"
            return dict(row, model_change=self.model_changes)

    def run_shard(self, shard: Shard, task: TaskSpec, attempt: int) -> tuple[pa.Table, dict]:
        engine = self._acquire(shard_profile(shard))
        try:
            return self._run(engine, shard, task, attempt)
        finally:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()

    def switch(self, model_name: str) -> dict:
        """Put the running engine to sleep and wake `model_name`'s (started earlier with `sleep_mode`): a
        model switch without a restart. Waits for the shards in flight; returns the switch's telemetry row."""
        with self._cv:
            while self._inflight:
                self._cv.wait()
            if model_name not in self.asleep:
                raise ValueError(f"model {model_name}: no engine of it sleeps here (asleep: {', '.join(self.asleep) or 'none'})")
            at, started = time.time(), time.perf_counter()
            slept = self.model.name
            self.engine.sleep()
            slept_at = time.perf_counter()
            self.asleep[slept] = (self.model, self.model_path, self.engine)
            self.model, self.model_path, self.engine = self.asleep.pop(model_name)
            self.engine.wake_up()
            woke_at = time.perf_counter()
            self.switches += 1
            return {"actor_id": self.actor_id, "node_ip": self.node_ip, "gpu_name": self.gpu_name,
                    "engine": self.engine.kind, "switch_index": self.switches - 1, "slept_model": slept,
                    "model": model_name, "at": utc(at), "sleep_s": slept_at - started, "wake_s": woke_at - slept_at,
                    "switch_s": woke_at - started}

    def close(self) -> None:
        """Let go of the engines (vLLM's engine-core processes with them) before the actor is killed: each shut
        down here, or an engine process's all at once (actors/local_engine.py, actors/hosted_engine.py)."""
        self.gpu.stop()
        engines = [engine for _, _, engine in self.asleep.values()] + [self.engine] * (self.engine is not None)
        self.asleep.clear()
        self.engine = None
        self.engines.close(engines)

    def exit(self) -> None:
        """Test hook: die as a crashed engine would."""
        os._exit(1)

    def _acquire(self, profile: EngineProfile):
        with self._cv:
            while not runs_profile(self.engine, profile) and self._inflight > 0:
                self._cv.wait()
            if not runs_profile(self.engine, profile):
                requested_at = time.time()
                self.engine.close()
                self.restarts += 1
                self._starts.append(self._start_engine(profile, requested_at, "profile"))
            self._inflight += 1
            return self.engine

    def _start_engine(self, profile: EngineProfile, engine_requested_at: float, reason: str) -> dict:
        gpu_fraction = self.num_gpus if self.num_gpus else 1.0
        self.engine = self.engines.start_engine(model=self.model, model_path=self.model_path, profile=profile,
                            num_threads=max(1, int(self.num_cpus)), gpu_fraction=gpu_fraction,
                            sleep_mode=self.sleep_mode, reproducible=self.reproducible)
        ready_at = time.time()
        first, self._first = self._first, {}  # the process and its imports belong to the first start only
        requested_at = engine_requested_at
        if first:  # its clock runs from the actor's request; the wait for a model sits between
            requested_at = first.pop("requested_at")
            first["waiting_s"] = since(self._imported_at, engine_requested_at)
        return self._engine_row(profile, requested_at, ready_at, reason, {**first, **self.engine.startup()})

    def _swapped(self, model: ModelSpec, model_path: str, profile: EngineProfile, requested_at: float) -> dict | None:
        """`model`'s weights loaded into the running engine where it is another checkpoint of the engine's model
        (actors/weight_swap.py): its telemetry/actors row (reason `weights`), whose engine figures are the swap's
        (weights_s), those of building an engine none. None where it is not. A swap that raised fails the start
        (the driver says it, as any engine's that could not start), its engine closed: its weights are neither
        model's now."""
        if not runs_profile(self.engine, profile) or why_not_swapped(
                self.engine.kind, self.model, self.model_path, model, model_path) is not None:
            return None
        try:
            swapped = self.engine.swap_weights(model_path)
        except Exception as e:
            engine, self.engine = self.engine, None
            engine.close()
            raise not_swapped(self.model, model, e) from e
        ready_at = time.time()
        self.model, self.model_path = model, model_path
        self.model_changes += 1
        figures = {**self.engine.startup(), **dict.fromkeys(BUILD_FIGURES), "built_at": utc(ready_at), **swapped}
        return self._engine_row(self.engine.profile, requested_at, ready_at, "weights", figures)

    def _engine_row(self, profile: EngineProfile, requested_at: float, ready_at: float, reason: str,
                    figures: dict) -> dict:
        self.engine_starts += 1
        return {"actor_id": self.actor_id, "node_ip": self.node_ip, "node_id": self.node_id,
                "gpu_name": self.gpu_name, "gpus": len(self.gpu_ids), "gpu_ids": ",".join(self.gpu_ids),
                "model": self.model.name, "engine": self.engine.kind,
                "profile": profile.name, "start_index": self.engine_starts - 1, "reason": reason,
                "restart": self.restarts, "model_change": self.model_changes,
                "requested_at": utc(requested_at), "ready_at": utc(ready_at),
                "process_started_at": None, "process_s": None, "imports_s": None, "waiting_s": None,
                "startup_s": since(requested_at, ready_at), "first_token_s": None,  # filled by the driver
                "engine_process": self.engine.where, **figures}

    def _run(self, engine, shard: Shard, task: TaskSpec, attempt: int) -> tuple[pa.Table, dict]:
        started_at, started, t0 = datetime.now(timezone.utc), time.perf_counter(), time.time()
        rows = shard.rows.to_pylist()
        counters = getattr(engine, "batch_counters", None)  # vLLM only: how full the engine's batch was
        before = counters() if counters else None
        done = engine.run_rows(rows, task, shard.add_special_tokens)  # encoded where the engine and its tokenizer are
        after = counters() if counters else None
        steps = after[0] - before[0] if counters else 0
        wall = time.perf_counter() - started
        self.gpu.sample_now()  # a reading at the shard's end, so a short shard has one too
        output_tokens, ttfts = done.output_tokens, done.ttfts
        runnable = [r for r in rows if r["status"] not in NOT_RUN]
        info = engine.startup()
        with self._cv:
            engine_starts, self._starts = self._starts, []
        telemetry = {
            "shard_id": shard.shard_id, "model": shard.model, "task": shard.task, "attempt": attempt,
            "actor_id": self.actor_id, "node_ip": self.node_ip,
            "node_id": self.node_id,
            "gpu_name": self.gpu_name, "engine": engine.kind, "cuda_graphs": info["cuda_graphs"],
            "graph_mode": info["graph_mode"], "profile": shard.profile,
            "chunked_prefill": info.get("chunked_prefill", False),
            "max_num_batched_tokens": info.get("max_num_batched_tokens"),
            "n_samples": len(rows), "prompt_tokens": int(sum(r["prompt_tokens"] for r in runnable)),
            "prompt_tokens_requested": done.prompt_tokens_requested,
            "prompt_tokens_computed": done.prompt_tokens_computed,
            "output_tokens": output_tokens, "wall_s": wall,
            "output_tok_per_s": output_tokens / wall if wall > 0 and not task.loglikelihood else None,
            # mean requests in the engine per step while this shard ran (all shards in flight counted)
            "engine_batch_mean": (after[1] - before[1]) / steps if steps else None,
            **self.gpu.aggregates(since=t0),  # NVML over this shard's run; None where there is no GPU
            "engine_restarts": self.restarts,
            # the engine this shard ran on (telemetry/actors start_index) and its first token here: the
            # driver keeps the earliest as that engine start's first_token_s
            "engine_start_index": self.engine_starts - 1,
            "first_token_at": utc(t0 + min(ttfts)) if ttfts else None,
            "started_at": started_at, "finished_at": datetime.now(timezone.utc), "error": None,
            "engine_starts": engine_starts,  # restarts since the last report, for telemetry/actors
            "gpu_samples": [dict(sample, actor_id=self.actor_id, node_id=self.node_id, gpu_name=self.gpu_name)
                            for sample in self.gpu.drain()],  # for telemetry/gpu.parquet
        }
        return actor_table(done.rows), telemetry


def _identity() -> tuple[str, str | None, str | None]:
    """Actor id, node IP and node id (fake multi-node clusters share one IP; ids tell nodes apart)."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return (ctx.get_actor_id() or f"driver-{os.getpid()}", ray.util.get_node_ip_address(),
                    ctx.get_node_id())
    except ImportError:
        pass
    return f"local-{os.getpid()}", None, None


def _node_gpus(node_id: str | None) -> float | None:
    """The GPUs Ray counts on this actor's node, None outside Ray or where the node is not listed."""
    try:
        import ray

        if node_id and ray.is_initialized():
            return next((n["Resources"].get("GPU") for n in ray.nodes() if n.get("NodeID") == node_id), None)
    except ImportError:
        pass
    return None


def _gpu_ids() -> list[str]:
    """The ids of the GPUs Ray assigned this actor (as strings), [] outside Ray or without GPUs."""
    try:
        import ray

        return [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
    except ImportError:
        return []
