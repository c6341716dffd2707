"""Fans shards out over a pool of Ray actors and collects them as they finish (`ray.wait`).

Each actor is kept `depth` shards deep, so it starts the next shard the moment it finishes one and a
slow shard never idles the others. Shards are routed by engine profile: an actor keeps taking shards of
the profile its engine runs, and changes profile (an engine restart) only when none of those are left
and it has nothing in flight. A shard whose actor dies is retried on a fresh actor; a shard that raises
is retried; after `max_attempts` it is reported as failed and the sweep goes on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.planner import Shard
from cluster.spec import TaskSpec


class ActorStartError(RuntimeError):
    """An actor died while starting its engine; the message carries the engine's own error."""


@dataclass
class Job:
    shard: Shard
    task: TaskSpec
    attempt: int = 1
    errors: list[str] = field(default_factory=list)


@dataclass
class _Slot:
    handle: Any
    number: int  # the n in the actor's name
    inflight: int = 0
    profile: str | None = None  # the profile of the last shard sent: what its engine runs now
    ready: bool = False  # its engine has started; shards go only to ready actors (one Ray cannot place
    # yet, e.g. no free GPU, must not hold shards hostage)


class _Pending:
    """Shards waiting, one queue per profile, each in the order given (retries go first)."""

    def __init__(self, jobs: list[Job]):
        self.queues: dict[str, deque] = {}
        for job in jobs:
            self.queues.setdefault(job.shard.profile, deque()).append(job)

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def retry(self, job: Job) -> None:
        self.queues.setdefault(job.shard.profile, deque()).appendleft(job)

    def take(self, slot: _Slot, slots: list[_Slot]) -> Job | None:
        same = self.queues.get(slot.profile)
        if same:
            return same.popleft()
        if slot.inflight:  # wait for the shards in flight rather than restart under them
            return None
        left = [p for p, q in self.queues.items() if q]
        if not left:
            return None
        served = {s.profile for s in slots if s is not slot}
        # a profile no other actor runs, else the longest queue
        profile = min(left, key=lambda p: (p in served, -len(self.queues[p])))
        return self.queues[profile].popleft()


@dataclass
class SchedulerEvents:
    """What the scheduler reports; the sink and progress reporting subscribe."""
    on_result: Callable[[Job, Any, dict], None]  # (job, results table, telemetry row)
    on_failed: Callable[[Job], None]  # every attempt failed; job.errors says why
    on_attempt_failed: Callable[[Job, str], None] = lambda job, error: None
    on_actor_started: Callable[[dict], None] = lambda row: None
    on_dispatched: Callable[[Job], None] = lambda job: None  # sent to an actor; comes back as one of the above


class ShardScheduler:
    def __init__(self, spawn: Callable[[int], Any], n_actors: int, events: SchedulerEvents,
                 max_attempts: int = 3, depth: int = 2, start_one_by_one: bool = False):
        if n_actors < 1 or max_attempts < 1 or depth < 1:
            raise ValueError("n_actors, max_attempts and depth must be >= 1")
        self.spawn, self.n_actors, self.events = spawn, n_actors, events
        self.max_attempts, self.depth = max_attempts, depth
        self.start_one_by_one = start_one_by_one  # engines sharing a GPU must not size their memory at once
        self.actors_started = 0
        self.actor_deaths = 0

    def run(self, jobs: list[Job]) -> None:
        pending = _Pending(jobs)
        slots: list[_Slot] = []
        inflight: dict[Any, tuple[str, Any, _Slot]] = {}
        try:
            for _ in range(min(self.n_actors, len(jobs))):
                if self.start_one_by_one:
                    slots.append(self._start_and_wait())
                else:
                    slots.append(slot := self._start())
                    inflight[slot.handle.startup.remote()] = ("startup", None, slot)
            while pending or any(kind == "shard" for kind, _, _ in inflight.values()):
                for slot in slots:
                    while slot.ready and slot.inflight < self.depth and (job := pending.take(slot, slots)) is not None:
                        inflight[slot.handle.run_shard.remote(job.shard, job.task, job.attempt)] = ("shard", job, slot)
                        slot.inflight += 1
                        slot.profile = job.shard.profile
                        self.events.on_dispatched(job)
                [ref], _ = ray.wait(list(inflight), num_returns=1)
                kind, job, slot = inflight.pop(ref)
                self._collect(ref, kind, job, slot, slots, pending, inflight)
        finally:
            self._shutdown(slots)

    @staticmethod
    def _shutdown(slots: list[_Slot], timeout_s: float = 120) -> None:
        """Close engines first (a killed actor would orphan vLLM's engine-core process and its GPU
        memory), then kill the actors; an actor already dead or stuck is just killed."""
        refs = [slot.handle.close.remote() for slot in slots if slot.ready]  # one never placed has no engine
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for slot in slots:
            ray.kill(slot.handle)

    def _collect(self, ref, kind: str, job: Job | None, slot: _Slot, slots: list[_Slot],
                 pending: _Pending, inflight: dict) -> None:
        if kind == "shard":
            slot.inflight -= 1
        try:
            value = ray.get(ref)
        except RayActorError as e:
            if kind == "startup" and e.actor_init_failed:  # the engine raised while starting (the model will
                raise ActorStartError(_first_line(e)) from e  # not load, no memory): it would again; stop here
            # the process died (killed, OOM, node lost), while starting or running: replace it
            if slot in slots:  # the first failure seen from this actor: replace it
                self._count_death(e)
                at = slots.index(slot)
                if self.start_one_by_one:
                    slots[at] = self._start_and_wait()
                else:
                    slots[at] = replacement = self._start()
                    inflight[replacement.handle.startup.remote()] = ("startup", None, replacement)
            if job is not None:
                self._retry(job, f"actor died: {_first_line(e)}", pending)
            return
        except RayTaskError as e:
            if job is None:
                raise  # engine start-up raised: the model cannot run, stop the sweep
            self._retry(job, _first_line(e.cause if e.cause is not None else e), pending)
            return
        if kind == "startup":
            slot.ready = True
            self.events.on_actor_started(value)
        else:
            self.events.on_result(job, *value)

    def _retry(self, job: Job, error: str, pending: _Pending) -> None:
        job.errors.append(error)
        self.events.on_attempt_failed(job, error)
        if job.attempt >= self.max_attempts:
            self.events.on_failed(job)
        else:
            job.attempt += 1
            pending.retry(job)

    def _count_death(self, error: RayActorError) -> None:
        self.actor_deaths += 1
        if self.actor_deaths > self.n_actors * self.max_attempts:
            raise RuntimeError(f"{self.actor_deaths} actors died; the last: {_first_line(error)}") from error

    def _start_and_wait(self) -> _Slot:
        """Start an actor and wait for its engine (engines sharing a GPU size their memory one at a
        time). As in the main loop, an engine that raises stops the sweep and a process that dies while
        starting is replaced."""
        while True:
            slot = self._start()
            try:
                self.events.on_actor_started(ray.get(slot.handle.startup.remote()))
            except RayActorError as e:
                if e.actor_init_failed:
                    raise ActorStartError(_first_line(e)) from e
                self._count_death(e)
                ray.kill(slot.handle)
                continue
            slot.ready = True
            return slot

    def _start(self) -> _Slot:
        number = self.actors_started
        self.actors_started += 1
        return _Slot(handle=self.spawn(number), number=number)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else text}"[:2000]
