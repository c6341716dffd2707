"""The engine pool's Ray Serve deployments (cluster/pool/serve_app.py builds and starts them).

- `PoolReplica`: one replica holds started engines on its GPU share, in the same `EvalActor` a sweep starts
  for itself (engine choice, profile restarts, telemetry), kept warm between sweeps: one model's engine, or,
  where the cluster cannot hold every pooled model at once, one engine per model with all but one asleep
  (vLLM's sleep mode: weights in CPU memory), switched by sleep and wake as shards ask for them.
  `run_shard` is what a sweep's client sends it; the shards wait in its ShardGate (actors/shard_gate.py:
  round robin between sweeps, the awake model first) for room in the engine. The telemetry row says which
  replica served the shard and carries the model switch its admission caused.
The application's ingress (what the pool serves, its HTTP API and live page) is cluster/pool/ingress.py.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from actors.evaluator import EvalActor
from actors.shard_gate import ShardGate
from cluster.contracts.shard import SHORT, Shard
from cluster.contracts.pool_protocol import ReplicaBroken
from cluster.contracts.spec import ModelSpec, TaskSpec


class PoolReplica:
    """A Serve replica with its engines started at construction (Serve marks it ready only then): the
    models in order, each put to sleep as the next starts where there are several; the last stays awake."""

    def __init__(self, models: list[ModelSpec], model_paths: list[str], num_cpus: float, num_gpus: float, depth: int,
                 reproducible: bool = False):
        requested_at = time.time()
        self.actor = EvalActor(requested_at, num_cpus, num_gpus, backends=tuple({m.backend for m in models}),
                               sleep_mode=len(models) > 1, reproducible=reproducible)
        if self.actor.refusal:  # the replica's GPU cannot run the pool's spec
            raise RuntimeError(self.actor.refusal)
        self.replica_id = _replica_id()
        self.started = {}
        for model, path in zip(models, model_paths):
            row = self.actor.start_engine(model, path, time.time())
            self.started[model.name] = dict(row, served_by=f"pool:{self.replica_id}")
        self.models = [m.name for m in models]
        self.executor = ThreadPoolExecutor(max_workers=depth + 1, thread_name_prefix="shard")
        # turns are taken per (model, engine profile): a model switch or a profile restart waits for an idle engine
        self.gate = ShardGate(depth, awake=(self.models[-1], SHORT), switch=self._switch)
        self._lock = threading.Lock()
        self.shards, self.switch_rows, self.broken = 0, [], None

    async def run_shard(self, shard: Shard, task: TaskSpec, attempt: int, sweep: str = "-", model: str | None = None):
        """Run one shard of `model` (the pool's name for it; the replica's only model where omitted) for
        `sweep`, once the gate gives it a turn."""
        model = model or self.models[0]
        if model not in self.models:
            raise ValueError(f"model {model}: this replica serves {', '.join(self.models)}")
        admission = await self.gate.enter(sweep, (model, shard.profile))
        loop = asyncio.get_running_loop()
        job = None
        try:
            if self.broken:
                raise ReplicaBroken(self.broken)
            if self.actor.model.name != model:  # never a shard on another model's engine
                raise ReplicaBroken(f"model {model}'s shard found model {self.actor.model.name}'s engine awake")
            job = loop.run_in_executor(self.executor, self.actor.run_shard, shard, task, attempt)
            table, telemetry = await asyncio.shield(job)  # a cancelled caller leaves the engine's work running
        finally:
            if job is not None and not job.done():  # cancelled: the turn ends when the engine's work does
                job.add_done_callback(lambda _: self.gate.leave())
            else:
                self.gate.leave()
        with self._lock:
            self.shards += 1
        # the pool's engine starts are not the sweep's (`raysweep pool status` shows them); a profile restart
        # this shard caused is, and comes in telemetry["engine_starts"] as from a sweep's own actor; so does
        # the model switch its admission caused, in telemetry["switches"]
        telemetry["served_by"] = f"pool:{self.replica_id}"
        telemetry["pool_sequence"] = admission.sequence
        telemetry["switches"] = [dict(admission.switch, served_by=telemetry["served_by"])] if admission.switch else []
        return table, telemetry

    async def _switch(self, group: tuple) -> dict | None:
        """The gate's switch to (model, profile): a model switch by sleep and wake (its telemetry row); a
        profile change alone is the engine's restart, done as the shard runs (EvalActor._acquire)."""
        model = group[0]
        if model == self.actor.model.name:
            return None
        try:
            row = await asyncio.get_running_loop().run_in_executor(self.executor, self.actor.switch, model)
        except Exception as e:  # the engines' state is unknown now: Serve replaces the replica
            self.broken = f"model switch to {model} failed: {type(e).__name__}: {e}"
            raise ReplicaBroken(self.broken) from None
        with self._lock:
            self.switch_rows.append(row)
        return row

    async def info(self) -> dict:
        """What `raysweep pool status` prints for this replica: per model its engine's start-up, and the
        model switches (sleep and wake) it made. (Async: it reads the gate in the gate's own event loop.)"""
        with self._lock:
            shards, switches = self.shards, [r["switch_s"] for r in self.switch_rows]
        keys = ("model", "engine", "node_ip", "gpu_name", "startup_s", "imports_s", "engine_init_s", "ready_at")
        return {"replica": self.replica_id, "shards": shards, "awake": self.gate.awake[0], "queued": self.gate.queued(),
                "switches": len(switches), "switch_median_s": statistics.median(switches) if switches else None,
                "engines": [{k: row.get(k) for k in keys} for row in self.started.values()]}

    def check_health(self) -> None:
        """Serve's health check: an engine that is gone or a failed switch makes the replica unhealthy
        (Serve replaces it)."""
        if self.broken:
            raise RuntimeError(self.broken)
        if self.actor.engine is None:
            raise RuntimeError("engine closed")

    def __del__(self):
        actor = getattr(self, "actor", None)
        if actor is not None:
            actor.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests construct the class directly)
        return f"local-{id(object())}"
