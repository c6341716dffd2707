"""Models whose engines are up before the sweep starts any: their shards go to those engines, as to a pool
(a slot of the fleet's, cluster/schedule/fleet.py add_pool), and no actor of the sweep's own starts for them
unless those engines go away.

1. Kept engines: an earlier sweep of this process kept its actors with their engines up (`KeptActors`,
   cluster/schedule/fleet.py); a model with the same path and engine arguments runs on them.
2. Otherwise the cluster's engine pool (cluster/pool/serve_app.py), for the models it serves with the same path
   and engine arguments, through a client actor of this sweep's.
3. Where the sweep uses the pool, its state goes to the pool's HTTP API as it runs and when it ends
   (`PoolStatus`).
"""

from __future__ import annotations

import os
from typing import Callable

import ray

from cluster.contracts.pool_protocol import SweepState
from cluster.contracts.spec import SweepSpec
from cluster.plan.depth import shards_in_flight
from cluster.schedule.fleet import KeptActors


def route(spec: SweepSpec, kept: KeptActors | None, fleet, log: Callable[[str], None]) -> tuple[dict, object]:
    """Steps 1 and 2: ({model name: what serves it}, the pool's recorder of the sweep's state or None)."""
    found = use_kept(spec, kept, fleet, log)
    return (found, None) if found else use_pool(spec, fleet, log)


def use_kept(spec: SweepSpec, kept: KeptActors | None, fleet, log: Callable[[str], None]) -> dict:
    """The models whose engines an earlier sweep of this process kept running: their shards go to those actors."""
    running = {m.name: kept.running(m) for m in spec.models} if kept is not None else {}
    models = {m.name: m for m in spec.models}
    for name, handles in running.items():
        for handle in handles:
            fleet.add_pool(name, handle, shards_in_flight(spec, models[name]))
    found = {name: handles for name, handles in running.items() if handles}
    if found:
        log(f"[raysweep] engines kept from this process's last sweep run model(s) {', '.join(found)}: "
            "their shards go to them")
    return found


def use_pool(spec: SweepSpec, fleet, log: Callable[[str], None]) -> tuple[dict, object]:
    """The sweep's models that the cluster's engine pool serves with the same path and engine arguments, and
    the recorder of the sweep's state for the pool (None where the pool serves none of them). The client is
    started first and reads the pool itself, so Serve is imported in its process, not here, while planning
    goes on; a sweep whose models the pool does not serve removes it at once."""
    from cluster.pool.served import pool_running

    if not pool_running():
        return {}, None
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
        return found, None
    for model, pooled in found.items():
        # every replica's engine full and as many shards waiting at it, where turns are taken
        # between sweeps and Serve sees the queue it scales on; a replica that switches between models
        # gets all it accepts (QUEUED_PER_SLOT per slot), so that the awake model's next shard is waiting
        # before its last one ends and the replica does not switch away and back (actors/shard_gate.py)
        waiting = QUEUED_PER_SLOT if pooled.switching else 2
        fleet.add_pool(model, PoolHandle(client, pooled), waiting * pooled.depth * pooled.max_replicas,
                       pooled.max_replicas)
    log(f"[raysweep] pool serves model(s) {', '.join(found)}: their shards go to it")
    return found, SweepRecorder(spec.name, client)


def pool_lost_line(models: list[str]) -> str:
    return (f"[raysweep] the engine pool went away during the sweep: model(s) {', '.join(models)} went on with "
            "the sweep's own actors")


class PoolStatus:
    """Step 3: the sweep's state, for the pool's HTTP API (cluster/pool/ingress.py), through `recorder`
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
