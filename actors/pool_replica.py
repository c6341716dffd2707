"""The engine pool's Ray Serve deployments (cluster/pool.py builds and starts them).

- `PoolReplica`: one replica holds one started engine of one model on its GPU share, the same `EvalActor`
  a sweep starts for itself (engine choice, profile restarts, telemetry), kept warm between sweeps.
  `run_shard` is what a sweep's scheduler sends it; the telemetry row says which replica served it.
- `PoolIngress`: the application's ingress, holding what the pool serves (models, resolved paths, engine
  arguments, deployment names), so a sweep can match its models against the pool's.
"""

from __future__ import annotations

import threading
import time

from actors.evaluator import EvalActor
from cluster.planner import Shard
from cluster.pool import ROUTE
from cluster.spec import ModelSpec, TaskSpec


class PoolReplica:
    """A Serve replica with one engine started at construction (Serve marks it ready only then)."""

    def __init__(self, model: ModelSpec, model_path: str, num_cpus: float, num_gpus: float):
        requested_at = time.time()
        self.actor = EvalActor(requested_at, num_cpus, num_gpus, backends=(model.backend,))
        self.replica_id = _replica_id()
        self.started = dict(self.actor.start_engine(model, model_path, time.time()), served_by=f"pool:{self.replica_id}")
        self._lock = threading.Lock()
        self.shards = 0

    def run_shard(self, shard: Shard, task: TaskSpec, attempt: int):
        table, telemetry = self.actor.run_shard(shard, task, attempt)
        with self._lock:
            self.shards += 1
        # the pool's engine start is not the sweep's (`raysweep pool status` shows it); a profile restart
        # this shard caused is, and comes in telemetry["engine_starts"] as from a sweep's own actor
        telemetry["served_by"] = f"pool:{self.replica_id}"
        return table, telemetry

    def info(self) -> dict:
        """What `raysweep pool status` prints for this replica."""
        with self._lock:
            shards = self.shards
        keys = ("model", "engine", "node_ip", "gpu_name", "startup_s", "imports_s", "engine_init_s", "ready_at")
        return {"replica": self.replica_id, "shards": shards, **{k: self.started.get(k) for k in keys}}

    def check_health(self) -> None:
        """Serve's health check: an engine that is gone makes the replica unhealthy (Serve replaces it)."""
        if self.actor.engine is None:
            raise RuntimeError("engine closed")

    def __del__(self):
        actor = getattr(self, "actor", None)
        if actor is not None:
            actor.close()


class PoolIngress:
    """The pool application's ingress: what it serves (for sweeps and `raysweep pool status`), and a
    read-only HTTP API over the sweeps that used the pool, from what each sweep records as it runs:

        GET /raysweep/sweeps                  every sweep: state, samples done of total, shards failed
        GET /raysweep/sweeps/NAME             one sweep: progress, shards, failures
        GET /raysweep/sweeps/NAME/summary     its summary table (model, task, n, score, ...) as JSON rows
    """

    def __init__(self, description: dict, *replicas):
        self.description = description
        self.replicas = replicas  # handles of the model deployments (keeps them in the application)
        self.sweeps: dict[str, dict] = {}

    def describe(self) -> dict:
        return self.description

    def record(self, name: str, snapshot: dict) -> None:
        """A sweep's state, sent by its driver as it runs and when it ends (cluster/pool.SweepRecorder)."""
        self.sweeps[name] = dict(snapshot, name=name, updated_at=time.time())

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        parts = [p for p in request.url.path.split("/") if p]
        if parts[:1] == [ROUTE.strip("/")]:  # the application's route prefix
            parts = parts[1:]
        if parts == ["sweeps"]:
            keys = ("name", "state", "samples_done", "samples_total", "shards_failed", "output", "updated_at")
            return JSONResponse([{k: s.get(k) for k in keys} for s in self.sweeps.values()])
        if len(parts) in (2, 3) and parts[0] == "sweeps":
            sweep = self.sweeps.get(parts[1])
            if sweep is None:
                return JSONResponse({"error": f"no sweep {parts[1]!r} has used this pool"}, status_code=404)
            if len(parts) == 2:
                return JSONResponse({k: v for k, v in sweep.items() if k != "summary"})
            if parts[2] == "summary":
                return JSONResponse(sweep.get("summary") or [])
        return JSONResponse({"error": "not found; try /raysweep/sweeps"}, status_code=404)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests construct the class directly)
        return f"local-{id(object())}"
