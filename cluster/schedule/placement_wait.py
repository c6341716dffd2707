"""Actors of the sweep that Ray has not placed yet. An actor waits for a node with the resources it asks for free:
other work may hold them (the engine pool's replicas, another job's actors), or the node is not there yet (the
autoscaler adding one). Ray keeps it pending without a word, and the sweep's progress would say "importing" for
ever; `PlacementWatch` tells them apart, for the progress line, and says once, in one line, what the waiting actors
ask for and what the cluster has free; once they are placed, that they were.

An actor counts as waiting when Ray says both: it is PENDING_CREATION in the actor table of its GCS with no worker
process yet (`Pid` 0: Ray keeps an actor PENDING_CREATION through its constructor, imports and all), read through
`ray._private.state.actors` (Ray's state API, `ray.util.state`, reads the same through the dashboard, which a local
run starts without); and the cluster has a resource request of its shape it cannot place now (the autoscaler's
demand, `ray.autoscaler.v2.sdk.get_cluster_status`), which an actor whose worker process is still starting does not
make. Each read takes about 2 ms. Where either cannot be read, nothing is said, and the actors count as importing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from cluster.contracts.shard import ActorState

LOOK_EVERY_S = 5.0  # how often the actor table is read while actors of the sweep are importing
SAY_AFTER_S = 10.0  # how long actors wait unplaced before the line says so
ACCELERATOR = "accelerator_type:"  # the prefix of an accelerator's resource (cluster/plan/placement.py)


def actor_name(sweep: str, number: int) -> str:
    """The name of the sweep's actor `number` (cluster/schedule/fleet_size.py names it so)."""
    return f"raysweep:{sweep}:{number}"


@dataclass(frozen=True)
class RayView:
    """What Ray says of placing actors now."""
    unstarted: set[str]  # the names of this job's actors PENDING_CREATION with no worker process yet
    demand: list[tuple[dict, int]]  # (bundle, count): the resource requests the cluster cannot place now


def ray_view() -> RayView | None:
    """RayView of the connected cluster; None where Ray does not say."""
    import ray

    try:
        from ray._private import state
        from ray.autoscaler.v2.sdk import get_cluster_status

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        table = state.actors(job_id=job, actor_state_name="PENDING_CREATION")
        status = get_cluster_status(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001  (private and fast-changing APIs: whatever they raise means "not known")
        return None
    demand = [(dict(by_count.bundle), by_count.count) for d in status.resource_demands.ray_task_actor_demand
              for by_count in d.bundles_by_count]
    return RayView({actor["Name"] for actor in table.values() if not actor.get("Pid")}, demand)


def _shape(bundle: dict) -> tuple[float, float]:
    """(CPU, GPU) of a bundle: what an actor's shape and the demand it makes are matched by."""
    return float(bundle.get("CPU", 0)), float(bundle.get("GPU", 0))


def cluster_room() -> tuple[dict, dict]:
    """(free, total) resources of the connected cluster."""
    import ray

    return ray.available_resources(), ray.cluster_resources()


def waiting_line(bundles: list[dict], free: dict, total: dict, pool_replicas: int) -> str:
    """One line: how many actors wait, what each asks for, and what the cluster has free of it."""
    amounts = [{k: v for k, v in b.items() if not k.startswith(ACCELERATOR)} for b in bundles]
    kinds = sorted({k[len(ACCELERATOR):] for b in bundles for k in b if k.startswith(ACCELERATOR)})
    shapes = sorted({", ".join(f"{k} {v:g}" for k, v in sorted(a.items())) for a in amounts if a})
    on = f" on an {' or '.join(kinds)} node" if kinds else ""
    room = ", ".join(f"{k} {free.get(k, 0):g} of {total.get(k, 0):g}" for k in sorted({k for a in amounts for k in a}))
    held = (f"other work holds the rest (the engine pool's {pool_replicas} replica(s) hold theirs until `raysweep "
            "pool down`), or no node has it" if pool_replicas else "other work holds the rest, or no node has it")
    return (f"[raysweep] {len(bundles)} actor(s) wait for Ray to place them: each asks for "
            f"{' or '.join(shapes) or 'its share'}{on}; the cluster has {room or 'nothing of it'} free: {held}. They "
            "start once it is freed or a node is added (`ray status` shows the demand); the sweep waits")


class PlacementWatch:
    """Which of the sweep's actors wait to be placed (`waiting`, slot numbers), looked at every LOOK_EVERY_S while
    some of its actors are importing, and said once they waited SAY_AFTER_S."""

    def __init__(self, sweep: str, log: Callable[[str], None], view: Callable[[], RayView | None] = ray_view,
                 room: Callable[[], tuple[dict, dict]] = cluster_room, pool: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic):
        """`pool()`: how many replicas of the engine pool run on the cluster (cluster/schedule/engine_sources.py)."""
        self.sweep, self.log, self._view, self._room, self._clock = sweep, log, view, room, clock
        self._pool = pool
        self.waiting: set[int] = set()
        self._since: float | None = None  # when the actors waiting now were first seen waiting
        self._said: set[int] = set()  # the actors the line was said of, for this wait
        self._looked = float("-inf")

    def look(self, slots: list) -> None:
        """Read which importing actors wait (at most every LOOK_EVERY_S); the line, once a wait is long enough."""
        importing = [s for s in slots if s.state is ActorState.IMPORTING and not s.lent]
        now = self._clock()
        if importing and now - self._looked < LOOK_EVERY_S:
            return
        self._looked = now
        view = self._view() if importing else RayView(set(), [])
        if view is None:
            return
        self.waiting = self._waiting(importing, view)
        if not self.waiting:
            placed = self._said & {s.number for s in slots}  # those that left the fleet (lost, stopped) were not
            if placed:
                waited = now - self._since
                self.log(f"[raysweep] the {len(placed)} actor(s) that waited were placed after {waited:.0f}s")
            self._since, self._said = None, set()
            return
        self._since = self._since if self._since is not None else now
        if not self._said and now - self._since >= SAY_AFTER_S:
            try:
                free, total = self._room()
            except Exception:  # noqa: BLE001  (the GCS did not answer: said at the next look)
                return
            self._said = set(self.waiting)
            bundles = [s.shape.bundle() if s.shape is not None else {} for s in importing if s.number in self.waiting]
            self.log(waiting_line(bundles, free, total, self._pool()))

    def _waiting(self, importing: list, view: RayView) -> set[int]:
        """The importing actors without a worker process, as many of each shape as the cluster's demand of it."""
        left: dict[tuple[float, float], int] = {}
        for bundle, count in view.demand:
            left[_shape(bundle)] = left.get(_shape(bundle), 0) + count
        waiting = set()
        for slot in importing:
            shape = _shape(slot.shape.bundle()) if slot.shape is not None else None
            if actor_name(self.sweep, slot.number) in view.unstarted and left.get(shape, 0) > 0:
                left[shape] -= 1
                waiting.add(slot.number)
        return waiting
