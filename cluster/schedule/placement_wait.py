"""Actors of the sweep that Ray has not placed yet. An actor waits for a node with the resources it asks for free:
other work may hold them (the engine pool's replicas, another job's actors), or the node is not there yet (the
autoscaler adding one). Ray keeps it pending without a word, and the sweep's progress would say "importing" for
ever; `PlacementWatch` tells them apart, for the progress line, and says once, in one line, what the waiting actors
ask for and what the cluster has free; once they are placed, that they were.

Which actors wait is read from Ray's actor table in its GCS (`ray._private.state.actors`, filtered to this job and
to PENDING_CREATION: about 2 ms). Ray keeps an actor PENDING_CREATION until its constructor returns, imports and
all; one that waits for a node has no worker process yet (its `Pid` is 0), and only those are counted. Ray's state
API (`ray.util.state`) reads the same table through the dashboard, which a local run starts without. Where the
table cannot be read, nothing is said, and the actors count as importing.
"""

from __future__ import annotations

import time
from typing import Callable

from cluster.contracts.shard import ActorState

LOOK_EVERY_S = 5.0  # how often the actor table is read while actors of the sweep are importing
SAY_AFTER_S = 10.0  # how long actors wait unplaced before the line says so
ACCELERATOR = "accelerator_type:"  # the prefix of an accelerator's resource (cluster/plan/placement.py)


def actor_name(sweep: str, number: int) -> str:
    """The name of the sweep's actor `number` (cluster/schedule/fleet_size.py names it so)."""
    return f"raysweep:{sweep}:{number}"


def unplaced_names() -> set[str] | None:
    """The names of this job's actors that no worker process was started for yet: they wait for a node with room.
    None where Ray's actor table cannot be read."""
    import ray

    try:
        from ray._private import state

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        table = state.actors(job_id=job, actor_state_name="PENDING_CREATION")
    except Exception:  # noqa: BLE001  (a private API: whatever it raises means "not known")
        return None
    return {actor["Name"] for actor in table.values() if not actor.get("Pid")}


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

    def __init__(self, sweep: str, log: Callable[[str], None], unplaced: Callable[[], set[str] | None] = unplaced_names,
                 room: Callable[[], tuple[dict, dict]] = cluster_room, pool: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic):
        """`pool()`: how many replicas of the engine pool run on the cluster (cluster/schedule/engine_sources.py)."""
        self.sweep, self.log, self._unplaced, self._room, self._clock = sweep, log, unplaced, room, clock
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
        names = self._unplaced() if importing else set()
        if names is None:
            return
        self.waiting = {s.number for s in importing if actor_name(self.sweep, s.number) in names}
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
