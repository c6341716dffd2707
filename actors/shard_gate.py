"""ShardGate: which waiting shard a pool replica runs next, when its engine has room.

A replica (actors/pool_replica.py) accepts more shards than its engine runs at once, so that shards wait
here, where the order is chosen, rather than in each sweep's own queue, first come first served:
- between sweeps, round robin: the next shard comes from the sweep served longest ago that has one waiting,
  so a sweep that arrives behind a long one gets every other turn at once, not after the long one's queue;
- between groups (a group is a model and its engine profile: a replica holding several models, one awake,
  switches between them; one engine changes profile by restarting), the awake group's shards go first, so
  switches are few: a switch waits until the awake group has no shard waiting, or has had `quantum`
  shards admitted while another group waited (so no group starves), and until the shards running have
  finished. A switch is done once, by `switch(group)`; the shards admitted behind it wait for it.

Asyncio, in the replica's event loop: a waiting shard costs a future, not a thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

SWITCH_QUANTUM = 16  # shards of the awake group admitted while another waits, before a switch


@dataclass
class Admission:
    """What `enter` returns: the shard's place in the replica's order, and the switch it caused (if any)."""
    sequence: int  # 1 for the replica's first admitted shard, then 2, 3, ...
    switch: dict | None = None  # the switch's telemetry row (a model switch), for the shard whose admission caused it


class ShardGate:
    FORGET_AFTER = 256  # sweeps remembered for turns; beyond, those with nothing waiting are forgotten

    def __init__(self, slots: int, awake, switch: Callable[[object], Awaitable[dict | None]],
                 quantum: int = SWITCH_QUANTUM):
        if slots < 1 or quantum < 1:
            raise ValueError("slots and quantum must be >= 1")
        self.slots, self.awake, self._switch, self.quantum = slots, awake, switch, quantum
        self.running = 0
        self.waiting: dict[object, dict[str, deque]] = {}  # group -> sweep -> (arrival, future) waiting
        self.turns: deque[str] = deque()  # sweeps, the one served longest ago first
        self.admitted = 0
        self.awake_turns = 0  # admissions of the awake group while another group waited
        self._switching: asyncio.Future | None = None
        self._arrivals = itertools.count()

    async def enter(self, sweep: str, group) -> Admission:
        """Wait for a turn in group `group`; the caller runs its shard, then calls `leave` (also when the
        shard raised)."""
        future = asyncio.get_running_loop().create_future()
        if len(self.turns) > self.FORGET_AFTER:
            self._forget_idle_sweeps()
        self.waiting.setdefault(group, {}).setdefault(sweep, deque()).append((next(self._arrivals), future))
        if sweep not in self.turns:
            self.turns.appendleft(sweep)  # never served: first in turn
        self._admit()
        try:
            sequence, switching, switched = await future
        except asyncio.CancelledError:  # the caller went away while waiting: its place goes
            if future.done() and not future.cancelled():
                self.leave()  # admitted in the same instant: give the turn back
            else:
                self._forget(group, sweep, future)
            raise
        if switching is not None:
            try:
                row = await asyncio.shield(switching)
            except BaseException:
                self.leave()
                raise
            return Admission(sequence, row if switched else None)
        return Admission(sequence)

    def leave(self) -> None:
        self.running -= 1
        self._admit()

    def queued(self) -> int:
        return sum(len(q) for sweeps in self.waiting.values() for q in sweeps.values())

    def _forget_idle_sweeps(self) -> None:
        idle = {s for s in self.turns if not any(sweeps.get(s) for sweeps in self.waiting.values())}
        self.turns = deque(s for s in self.turns if s not in idle)
        for sweeps in self.waiting.values():
            for sweep in idle & set(sweeps):
                del sweeps[sweep]

    def _admit(self) -> None:
        while self.running < self.slots:
            group = self._next_group()
            if group is None:
                return
            sweeps = self.waiting[group]
            sweep = next(s for s in self.turns if sweeps.get(s))
            self.turns.remove(sweep)
            self.turns.append(sweep)  # served now: last in turn
            _, future = sweeps[sweep].popleft()
            if future.done():  # cancelled
                continue
            switched = group != self.awake
            if switched:
                self.awake, self.awake_turns = group, 0
                self._switching = asyncio.ensure_future(self._switch(group))
            elif self._others_waiting(group):
                self.awake_turns += 1
            self.running += 1
            self.admitted += 1
            pending = self._switching if self._switching is not None and (
                not self._switching.done() or self._switching.cancelled() or self._switching.exception()) else None
            # (a switch that failed stays pending for every shard after it: none runs on the wrong engine)
            future.set_result((self.admitted, pending, switched))

    def _next_group(self) -> str | None:
        waiting = [m for m, sweeps in self.waiting.items() if any(sweeps.values())]
        if not waiting:
            return None
        if self.awake in waiting and (not self._others_waiting(self.awake) or self.awake_turns < self.quantum):
            return self.awake
        if self.running:  # a switch waits for the shards running on the awake engine
            return None
        return min((m for m in waiting if m != self.awake), key=self._oldest)

    def _others_waiting(self, group: str) -> bool:
        return any(any(q) for m, sweeps in self.waiting.items() if m != group for q in sweeps.values())

    def _oldest(self, group: str) -> int:
        return min(q[0][0] for q in self.waiting[group].values() if q)

    def _forget(self, group: str, sweep: str, future) -> None:
        queue = self.waiting.get(group, {}).get(sweep)
        if queue is not None:
            for item in list(queue):
                if item[1] is future:
                    queue.remove(item)
