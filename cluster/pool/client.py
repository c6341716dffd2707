"""A sweep's way into the engine pool: its `PoolClient` actor (reads what the pool serves, forwards shards to the
pool's deployments and turns the pool's failures into PoolGone or ReplicaDied), the handle the scheduler holds
for a pooled model, and the recorder that keeps the pool's HTTP API told of the sweep's progress.

Ray Serve is imported only in the client actor, never in the sweep's driver: its import (1.4 s on the 2-core
machine, on the driver's main thread) slowed the driver's planning thread, and the client, started only once
the pool had been read, imported it again before its first shard (bench/records/h200-warm-pool-and-lm-eval-ray-start.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.contracts.pool_protocol import APP, CLIENT_NAMESPACE, PoolGone, ReplicaBroken, ReplicaDied

if TYPE_CHECKING:
    from cluster.pool.served import PooledModel


def sweeps_using_pool() -> list[str]:
    """Sweeps whose PoolClient actor is alive (each sweep that uses the pool holds one, named after it), asked
    of the connected cluster's GCS (named actors are alive ones). An error is the caller's: "nobody" is never
    a guess (the state API once answered for another Ray on the same host, and the pool was removed)."""
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"].split(":")[1] for a in named
                  if a["name"].startswith("pool-client:") and a.get("namespace") == CLIENT_NAMESPACE)


def client_name(sweep: str) -> str:
    """One per run: a run whose models the pool does not serve kills its client at once, and Ray may not have
    freed the name when the same process runs the sweep again."""
    import os
    import uuid

    return f"pool-client:{sweep}:{os.getpid()}-{uuid.uuid4().hex[:8]}"


class PoolClient:
    """A sweep's way into the pool: an async actor that says what the pool serves (`pool`), forwards a shard
    to the model's deployment and returns its result, so the sweep's scheduler waits on a plain object ref
    like any actor call, and passes the sweep's state on to the pool's ingress (`record`). The replicas take
    turns between sweeps by the name given here. Serve is imported as the actor starts, while the driver plans."""

    def __init__(self, sweep: str):
        from ray import serve  # noqa: F401 (imported now, not at the first shard)

        self.sweep = sweep
        self._ingress = None  # the pool's ingress handle, once found (finding it asks Serve's controller)

    async def pool(self) -> tuple[dict, list[str]]:
        """What the pool serves (cluster/pool/served.read_pool), by model name, and what the sweep should be
        told about it (a pool that does not answer, or of another version)."""
        import asyncio

        said: list[str] = []
        return await asyncio.to_thread(_read_pool_and_handles, said.append), said

    async def record(self, run_id: str, snapshot: dict, final: bool = False) -> None:
        """The sweep's state, to the pool's ingress; the last one waited for (at most 10 s). Never fails."""
        import asyncio

        from ray import serve

        try:
            if self._ingress is None:  # a blocking call to Serve's controller: off the event loop that forwards shards
                self._ingress = await asyncio.to_thread(serve.get_app_handle, APP)
            response = self._ingress.record.remote(run_id, snapshot)
            if final:
                await asyncio.wait_for(_awaited(response), 10)
        except Exception:  # the pool went away: the sweep goes on
            pass

    async def run_shard(self, deployment: str, model: str, shard, task, attempt: int):
        import asyncio

        from ray import serve
        from ray.exceptions import RayActorError

        response = None
        try:
            handle = serve.get_deployment_handle(deployment, app_name=APP)
            response = handle.run_shard.remote(shard, task, attempt, self.sweep, model)
            waiting = asyncio.ensure_future(_awaited(response))
            while True:  # a request queued at Serve's router when the pool is deleted waits forever: watch
                done, _ = await asyncio.wait({waiting}, timeout=POOL_WATCH_S)
                if done:
                    return waiting.result()
                if await asyncio.to_thread(_pool_gone):
                    waiting.cancel()
                    response.cancel()
                    raise PoolGone("the pool was removed before the shard reached a replica")
        except PoolGone:
            raise
        except Exception as e:
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            if await asyncio.to_thread(_pool_gone):
                raise PoolGone(f"the pool was removed: {last}") from None
            if isinstance(e, (RayActorError, ReplicaBroken)):  # the replica died or broke: Serve replaces it
                raise ReplicaDied(f"the pool replica running the shard died: {type(e).__name__}: {last}") from None
            raise


POOL_WATCH_S = 2.0  # how often a shard waiting for the pool checks that the pool is still there


async def _awaited(response):
    return await response


def _read_pool_and_handles(log) -> dict:
    """What the pool serves, with each of its deployments' handles made now (making one asks Serve's controller,
    a blocking call: here, on a thread, not in the event loop that forwards the shards)."""
    from ray import serve

    from cluster.pool.served import read_pool

    served = read_pool(log)
    for model in served.values():
        try:
            serve.get_deployment_handle(model.deployment, app_name=APP)  # cached by Serve for run_shard
        except Exception:  # the pool is going away: run_shard says so
            pass
    return served


def _pool_gone() -> bool:
    """Whether the pool application is gone (or being deleted); False where Serve cannot say."""
    from ray import serve

    try:
        app = serve.status().applications.get(APP)
    except Exception:  # Serve cannot say: the caller's own error (if any) is classified by itself
        return False
    return app is None or str(getattr(app.status, "value", app.status)) == "DELETING"


class PoolHandle:
    """What the scheduler holds for a pooled model: `run_shard.remote(shard, task, attempt)`, as on an actor."""

    def __init__(self, client, model: PooledModel):
        self.run_shard = _Forward(client, model.deployment, model.name)


class _Forward:
    def __init__(self, client, deployment: str, model: str):
        self.client, self.deployment, self.model = client, deployment, model

    def remote(self, shard, task, attempt: int):
        return self.client.run_shard.remote(self.deployment, self.model, shard, task, attempt)


class SweepRecorder:
    """A sweep's state, sent through its pool client to the pool's ingress for its HTTP API
    (`GET /raysweep/sweeps/RUN`): at most once every RECORD_EVERY_S while it runs (a heartbeat: a sweep silent
    for longer than the ingress's GONE_AFTER_S is shown as gone), and once when it ends. Each run has its own
    id, so two sweeps of one name keep two records. Sending never blocks or fails the sweep."""

    RECORD_EVERY_S = 2.0

    def __init__(self, name: str, client):
        import uuid

        self.name, self.client, self._sent = name, client, 0.0
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"

    def record(self, snapshot: dict, final: bool = False) -> None:
        import time

        import ray

        now = time.monotonic()
        if not final and now - self._sent < self.RECORD_EVERY_S:
            return
        self._sent = now
        try:
            sent = self.client.record.remote(self.run_id, dict(snapshot, name=self.name), final)
            if final:
                ray.get(sent, timeout=15)
        except Exception:  # the client or the pool went away: the sweep goes on
            pass
