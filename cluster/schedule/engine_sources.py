"""Where a sweep's engines come from besides the actors it starts (cluster/schedule/fleet.py): engines already up
when it starts, lent to it for a model (`Fleet.lend`). The scheduler sends a lent model's shards to them as to an
actor and starts no actor of the sweep's own for it, unless they go away.

Every source answers one call, `lend(spec, log)`: a `Lent` for each model whose engines it has up with the same path
and engine arguments, and what records the sweep's state for it (or None). The first source that lends anything is
the sweep's (`lend`):
1. `KeptEngines`: an earlier sweep of this process kept its actors with their engines up (`KeptActors`,
   cluster/schedule/fleet.py).
2. `PoolEngines`: the cluster's engine pool (cluster/pool/serve_app.py), through a client actor of this sweep's;
   the sweep's state goes to the pool's HTTP API as it runs and when it ends (`PoolStatus`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import ray

from cluster.contracts.pool_protocol import SweepState
from cluster.contracts.spec import SweepSpec
from cluster.plan.depth import shards_in_flight
from cluster.schedule.fleet import KeptActors


@dataclass(frozen=True)
class Lent:
    """Engines lent to the sweep for one model."""
    model: str
    handle: Any  # `run_shard.remote(shard, task, attempt)`, as an actor's
    depth: int  # shards it holds at once
    replicas: int = 1  # the most engines behind it


def engine_sources(kept: KeptActors | None) -> list:
    """The sources a sweep asks, in order: this process's kept engines, then the cluster's pool."""
    return ([KeptEngines(kept)] if kept is not None else []) + [PoolEngines()]


def pool_replicas() -> int:
    """How many replicas of the engine pool run on the connected cluster (said where the sweep's actors wait for
    room they may hold: cluster/schedule/placement_wait.py)."""
    from cluster.pool.served import pool_replicas as replicas

    return replicas()


@dataclass(frozen=True)
class Lending:
    """What a sweep was lent: its models, the recorder of its state for the source (or None), and the line should
    the engines go away during the sweep."""
    models: frozenset = frozenset()
    recorder: object = None
    gone: str = ""

    def gone_line(self, models: list[str]) -> str:
        return self.gone.format(", ".join(models))


def lend(spec: SweepSpec, sources: list, fleet, log: Callable[[str], None]) -> Lending:
    """The engines of the first source that lends any, each made a slot of `fleet`."""
    for source in sources:
        lent, recorder = source.lend(spec, log)
        if lent:
            for engines in lent:
                fleet.lend(engines.model, engines.handle, engines.depth, engines.replicas)
            models = list(dict.fromkeys(engines.model for engines in lent))  # in the spec's order
            log(source.said.format(", ".join(models)))
            return Lending(frozenset(models), recorder, source.gone)
    return Lending()


class KeptEngines:
    said = "[raysweep] engines kept from this process's last sweep run model(s) {}: their shards go to them"
    gone = ("[raysweep] engines kept from this process's last sweep went away during the sweep: model(s) {} went on "
            "with the sweep's own actors")

    def __init__(self, kept: KeptActors):
        self.kept = kept

    def lend(self, spec: SweepSpec, log: Callable[[str], None]) -> tuple[list[Lent], None]:
        """One `Lent` per kept actor whose engine runs a model of the sweep (same name, path and arguments)."""
        return [Lent(m.name, handle, shards_in_flight(spec, m)) for m in spec.models
                for handle in self.kept.running(m)], None


class PoolEngines:
    said = "[raysweep] pool serves model(s) {}: their shards go to it"
    gone = "[raysweep] the engine pool went away during the sweep: model(s) {} went on with the sweep's own actors"

    def lend(self, spec: SweepSpec, log: Callable[[str], None]) -> tuple[list[Lent], object]:
        """The sweep's models that the pool serves with the same path and engine arguments, and the recorder of
        the sweep's state for the pool. The client is started first and reads the pool itself, so Serve is
        imported in its process, not here, while planning goes on; a sweep whose models the pool does not serve
        removes it at once."""
        from cluster.pool.served import pool_running

        if not pool_running():
            return [], None
        from cluster.contracts.pool_protocol import CLIENT_NAMESPACE, QUEUED_PER_SLOT
        from cluster.inputs.builtin_model import resolve_model_path
        from cluster.pool.client import PoolClient, PoolHandle, SweepRecorder, client_name
        from cluster.pool.served import find_pool

        name = client_name(spec.name)  # the replicas take turns between sweeps by this name
        client = ray.remote(PoolClient).options(name=name, namespace=CLIENT_NAMESPACE, num_cpus=0,
                                                max_concurrency=1000).remote(name)
        try:
            served, said = ray.get(client.pool.remote(), timeout=120)
        except Exception as e:  # the client could not start or read the pool: the sweep's own actors run it
            served, said = {}, [f"[raysweep] the engine pool could not be read ({type(e).__name__}: "
                                f"{(str(e).strip().splitlines() or [''])[-1][:200]}): the sweep runs on its own actors"]
        for line in said:
            log(line)
        paths = {m.name: resolve_model_path(spec.model_path(m)) for m in spec.models}
        found = find_pool(spec, paths, served, log)
        if not found:
            ray.kill(client)
            return [], None
        # every replica's engine full and as many shards waiting at it, where turns are taken between sweeps and
        # Serve sees the queue it scales on; a replica that switches between models gets all it accepts
        # (QUEUED_PER_SLOT per slot), so that the awake model's next shard is waiting before its last one ends and
        # the replica does not switch away and back (actors/shard_gate.py)
        return [Lent(model, PoolHandle(client, pooled),
                     (QUEUED_PER_SLOT if pooled.switching else 2) * pooled.depth * pooled.max_replicas,
                     pooled.max_replicas) for model, pooled in found.items()], SweepRecorder(spec.name, client)


class PoolStatus:
    """The sweep's state, for the pool's HTTP API (cluster/pool/ingress.py), through `recorder`
    (cluster/pool/client.py SweepRecorder); without one (no pool used), nothing is sent."""

    def __init__(self, sink, progress, report, recorder=None):
        self.sink, self.progress, self.report, self.recorder = sink, progress, report, recorder

    def record(self, state: SweepState, summary: list | None = None) -> None:
        """`summary`: the run's summary rows, once it ends (the last record, waited for)."""
        if self.recorder is None:
            return
        failed = self.sink.failed()
        output = self.report.output  # the ingress (another process, maybe another node) needs it whole
        output = output if "://" in output else os.path.abspath(output)
        self.recorder.record({"state": state.value, "output": output, "samples_done": self.progress.done,
                              "samples_total": self.progress.total,
                              "shards_total": self.report.shards_run + self.report.shards_skipped,
                              "shards_committed": len(self.sink.committed()), "shards_failed": len(failed),
                              "failures": {sid: e["errors"][-1] for sid, e in failed.items() if e.get("errors")},
                              "summary": summary}, final=summary is not None)
