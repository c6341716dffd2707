"""Actors of the sweep that Ray has not placed yet. An actor waits for a node with the resources it asks for free:
other work may hold them (a Serve pool's replicas, another job's actors), or the node is not there yet (the
autoscaler adding one). Ray keeps it pending without a word, and the sweep's progress would say "importing" for
ever; `PlacementWatch` tells them apart, for the progress line, and says once, in one line, what the waiting actors
ask for and what the cluster has free; once they are placed, that they were.

Which actors wait is read from Ray's actor table in its GCS (`ray._private.state.actors`, filtered to this job and
to PENDING_CREATION: about 2 ms). Ray's state API (`ray.util.state`) reads the same through the dashboard, which a
local run starts without. Where the table cannot be read, nothing is said, and the actors count as importing.
"""

from __future__ import annotations

import time
from typing import Callable

from cluster.contracts.shard import ActorState

LOOK_EVERY_S = 5.0  # how often the actor table is read while actors of the sweep are importing
SAY_AFTER_S = 10.0  # how long actors wait unplaced before the line says so


def actor_name(sweep: str, number: int) -> str:
    """The name of the sweep's actor `number` (cluster/schedule/fleet_size.py names it so)."""
    return f"raysweep:{sweep}:{number}"


def pending_names() -> set[str] | None:
    """The names of this job's actors that Ray has not placed yet; None where its actor table cannot be read."""
    import ray

    try:
        from ray._private import state

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        table = state.actors(job_id=job, actor_state_name="PENDING_CREATION")
    except Exception:  # noqa: BLE001  (a private API: whatever it raises means "not known")
        return None
    return {actor["Name"] for actor in table.values()}


def cluster_room() -> tuple[dict, dict]:
    """(free, total) resources of the connected cluster."""
    import ray

    return ray.available_resources(), ray.cluster_resources()


def waiting_line(bundles: list[dict], free: dict, total: dict, pool: bool) -> str:
    """One line: how many actors wait, what each asks for, and what the cluster has free of it."""
    asked = sorted({key for bundle in bundles for key in bundle})
    shapes = sorted({", ".join(f"{k} {_number(v)}" for k, v in sorted(b.items())) for b in bundles if b})
    room = ", ".join(f"{k} {_number(free.get(k, 0))} of {_number(total.get(k, 0))}" for k in asked)
    held = ("other work holds the rest (a Ray Serve pool runs on this cluster: its replicas hold theirs until "
            "`raysweep pool down`)" if pool else "other work holds the rest, or no node has it")
    return (f"[raysweep] {len(bundles)} actor(s) wait for Ray to place them: each asks for {' or '.join(shapes) or 'its share'}; "
            f"the cluster has {room} free: {held}. They start once it is freed or a node is added (`ray status` "
            "shows the demand); the sweep waits")


def _number(value: float) -> str:
    return f"{value:g}"


class PlacementWatch:
    """Which of the sweep's actors wait to be placed (`waiting`, slot numbers), looked at every LOOK_EVERY_S while
    some of its actors are importing, and said once they waited SAY_AFTER_S."""

    def __init__(self, sweep: str, log: Callable[[str], None], pending: Callable[[], set[str] | None] = pending_names,
                 room: Callable[[], tuple[dict, dict]] = cluster_room, pool: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic):
        """`pool()`: whether a Ray Serve pool runs on the cluster (cluster/schedule/engine_sources.py pool_runs)."""
        self.sweep, self.log, self._pending, self._room, self._clock = sweep, log, pending, room, clock
        self._pool = pool
        self.waiting: set[int] = set()
        self._since: float | None = None  # when the actors waiting now were first seen waiting
        self._said = False  # the line said for this wait
        self._looked = float("-inf")

    def look(self, slots: list) -> None:
        """Read which importing actors wait (at most every LOOK_EVERY_S); the line, once a wait is long enough."""
        importing = [s for s in slots if s.state is ActorState.IMPORTING and not s.lent]
        now = self._clock()
        if importing and now - self._looked < LOOK_EVERY_S:
            return
        self._looked = now
        names = self._pending() if importing else set()
        if names is None:
            return
        self.waiting = {s.number for s in importing if actor_name(self.sweep, s.number) in names}
        if not self.waiting:
            if self._said:
                self.log(f"[raysweep] the actors that waited were placed after {now - self._since:.0f}s")
            self._since, self._said = None, False
            return
        self._since = self._since if self._since is not None else now
        if not self._said and now - self._since >= SAY_AFTER_S:
            self._said = True
            free, total = self._room()
            bundles = [s.shape.bundle() if s.shape is not None else {} for s in importing if s.number in self.waiting]
            self.log(waiting_line(bundles, free, total, self._pool()))
