"""Stand-ins for Ray under the scheduler (cluster/schedule/actor_io.py's interface): actor handles whose calls are
answered by a script, at once or never, and the I/O that hands those answers to the scheduler. No Ray starts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.contracts.shard import ACTOR_METHODS
from cluster.schedule.actor_io import ActorLost, Answered, CallRaised, EnginesGone, Outcome


@dataclass(eq=False)
class FakeRef:
    handle: FakeHandle
    method: str
    args: tuple
    number: int


class _Method:
    def __init__(self, handle: FakeHandle, name: str):
        self.handle, self.name = handle, name

    def remote(self, *args):
        return self.handle.io.sent(self.handle, self.name, args)


@dataclass(eq=False)
class FakeHandle:
    """An actor handle: `handle.method.remote(*args)` is a call the FakeIO's script answers."""
    io: FakeIO
    number: int
    shape: Any = None
    killed: bool = False
    closed: bool = False

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)


@dataclass
class FakeIO:
    """`script(handle, method, args)`: the call's Outcome, or None for one that never answers. Answers come back
    in the order the calls were made."""
    script: Callable[[FakeHandle, str, tuple], Outcome | None]
    calls: list = field(default_factory=list)  # every FakeRef, in order
    handles: list = field(default_factory=list)  # every actor spawned
    _answers: dict = field(default_factory=dict)
    _numbers: Any = field(default_factory=itertools.count)

    def spawn(self, number: int, requested_at: float, shape: Any) -> FakeHandle:
        handle = FakeHandle(self, number, shape)
        self.handles.append(handle)
        return handle

    def sent(self, handle: FakeHandle, method: str, args: tuple) -> FakeRef:
        ref = FakeRef(handle, method, args, next(self._numbers))
        self.calls.append(ref)
        if not handle.killed:
            answer = self.script(handle, method, args)
            if answer is not None:
                self._answers[ref] = answer
        return ref

    # -- cluster/schedule/actor_io.py's interface -------------------------------------------------------------
    def send(self, call) -> FakeRef:
        return getattr(call.slot.handle, ACTOR_METHODS[call.kind]).remote(*call.args)

    def wait(self, refs: list, timeout_s: float) -> list:
        ready = sorted((r for r in refs if r in self._answers), key=lambda r: r.number)
        return ready[:1]

    def answered(self, ref) -> bool:
        return ref in self._answers

    def outcome(self, ref) -> Outcome:
        return self._answers.pop(ref)

    def kill(self, handle: FakeHandle) -> None:
        """As ray.kill: its calls not read yet fail as calls to a dead actor."""
        handle.killed = True
        for ref in [r for r in self._answers if r.handle is handle]:
            self._answers[ref] = ActorLost(RuntimeError(f"The actor {handle.number} was killed."))

    def close(self, running: list, handles: list, timeout_s: float = 120) -> None:
        for handle in running:
            handle.closed = True
        for handle in handles:
            handle.killed = True


__all__ = ["ActorLost", "Answered", "CallRaised", "EnginesGone", "FakeHandle", "FakeIO", "FakeRef"]
