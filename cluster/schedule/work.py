"""A shard's life in the scheduler (cluster/schedule/scheduler.py): the job that carries a shard through its
attempts, bisection (cluster/schedule/bisection.py) and tail splits (cluster/schedule/tail_split.py); a model's
queues, one per engine profile; an actor slot (cluster/schedule/fleet.py); the calls in flight; and the events
the scheduler reports.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable

from cluster.contracts.shard import ActorCall, ActorState, Shard
from cluster.schedule.bisection import Piece
from cluster.contracts.spec import TaskSpec

# Slot states by what the scheduler asks of them (cluster/contracts/shard.py ActorState)
SERVING = (ActorState.RUNNING, ActorState.STARTING)  # slots that serve a model, or will once started
FREE = (ActorState.IMPORTING, ActorState.IDLE)  # actors with no model yet
ENGINE_HELD = (ActorState.STARTING, ActorState.RUNNING, ActorState.IDLE)  # actors whose engine a node loss ends
UP = (ActorState.IDLE, ActorState.RUNNING)  # actors that answer a close

# The slot state machine: every change of a Slot's state goes through `advance`, and only these. A slot is made
# IMPORTING (an actor of the sweep's) or RUNNING (engines lent to the sweep: kept from an earlier sweep, or the
# pool's), and leaves from any state (lost, stopped, released).
TRANSITIONS = {
    ActorState.IMPORTING: {ActorState.IDLE},  # its imports are done (`ready` answered)
    ActorState.IDLE: {ActorState.STARTING},  # given a model: its engine starts
    ActorState.STARTING: {ActorState.RUNNING,  # the engine is up
                          ActorState.IDLE},  # the engine raised or hung: the model given up there
    ActorState.RUNNING: {ActorState.STARTING},  # its model done: given another (never a lent slot)
}


def advance(slot: "Slot", state: ActorState) -> None:
    if state not in TRANSITIONS[slot.state]:
        raise AssertionError(f"actor slot {slot.number}: {slot.state.value} -> {state.value} is not a transition "
                             "of the scheduler's (cluster/schedule/work.py TRANSITIONS)")
    slot.state = state


@dataclass
class Job:
    shard: Shard
    task: TaskSpec
    attempt: int = 1
    errors: list[str] = field(default_factory=list)
    piece: Piece | None = None  # a part of a shard being bisected; None for a whole shard


class ModelState(Enum):
    """Where a model stands for the scheduler: its checks still running (actors may start for it, no engine),
    ready (its engines may start), or given up (no engine of it could start: its shards fail)."""
    CHECKING = auto()
    READY = auto()
    FAILED = auto()


@dataclass
class ModelWork:
    """One model as the scheduler sees it."""
    name: str
    max_actors: int  # actors that may run it at once
    depth: int  # shards in flight per actor
    # requested_at -> the arguments of an actor's `start_engine` call; None until the model passed its checks:
    # actors are started for it meanwhile, but no engine
    start: Callable[[float], tuple] | None = None
    queues: dict[str, deque] = field(default_factory=dict)  # shards waiting, one queue per profile
    assigned: int = 0  # actors running or starting it
    error: str | None = None  # the engine's error, once the model is given up (ModelState.FAILED)
    # the kind of actor it runs on (cluster/plan/placement.py ActorResources: an engine of N GPUs needs actors of
    # N GPUs); models of one shape share actors, one of another shape gets actors of its own
    shape: Any = None
    # equal for checkpoints of one model (cluster/contracts/checkpoint.py): an actor changing between them keeps
    # its engine and loads the weights; None until the model is ready, or where its files were not read
    family: str | None = None

    def ready(self, model, path: str, family: str | None = None) -> None:
        """The model passed its checks: `start` gives an actor's `start_engine` arguments from now on."""
        self.start = lambda at: (model, path, at)
        self.family = family

    @property
    def state(self) -> ModelState:
        if self.error is not None:
            return ModelState.FAILED
        return ModelState.CHECKING if self.start is None else ModelState.READY

    @property
    def failed(self) -> bool:
        return self.state is ModelState.FAILED

    def give_up(self, error: str) -> None:
        """No engine of the model can start: FAILED, with the engine's error."""
        self.error = error

    def add(self, job: Job, first: bool = False) -> None:
        queue = self.queues.setdefault(job.shard.profile, deque())
        queue.appendleft(job) if first else queue.append(job)  # retries go first

    def waiting(self) -> int:
        """Shards in its queues."""
        return sum(len(q) for q in self.queues.values())

    def samples_left(self) -> int:
        return sum(job.shard.n_samples for q in self.queues.values() for job in q)

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def take(self, slot: Slot, others: list[Slot]) -> Job | None:
        if slot.lent:  # engines lent to the sweep change profile themselves: the longest queue first
            left = [q for q in self.queues.values() if q]
            return max(left, key=len).popleft() if left else None
        same = self.queues.get(slot.profile)
        if same:
            return same.popleft()
        if slot.inflight:  # wait for the shards in flight rather than restart under them
            return None
        left = [p for p, q in self.queues.items() if q]
        if not left:
            return None
        served = {s.profile for s in others if s is not slot and s.model == self.name}
        profile = min(left, key=lambda p: (p in served, -len(self.queues[p])))  # unserved, else the longest
        return self.queues[profile].popleft()


@dataclass
class Slot:
    """Where the scheduler sends a model's shards: an actor of the sweep's, or engines lent to it for one model
    (`lent`: kept from an earlier sweep, or the pool's through its client: cluster/schedule/engine_sources.py),
    which the sweep neither starts nor releases."""
    handle: Any
    number: int  # the n in the actor's name
    state: ActorState = ActorState.IMPORTING
    model: str | None = None  # the model its engine runs (or is starting)
    inflight: int = 0
    profile: str | None = None  # the profile of the last shard sent: what its engine runs now
    refused: set = field(default_factory=set)  # models whose engine failed to start here
    depth: int | None = None  # shards it holds at once, where not its model's per-actor depth (lent engines)
    lent: bool = False  # engines up before the sweep, lent to it for `model`
    actors: int = 0  # lent: the model's own actors should the lent engines go away
    replicas: int = 0  # lent: the most engines behind it (the pool's replicas of the model)
    shape: Any = None  # the resources it holds (ModelWork.shape): it runs only models of that shape
    start_at: float | None = None  # time.monotonic() when its engine start was asked for
    node: tuple[str, str] | None = None  # (Ray node id, its IP) of the node it runs on, once it is ready


@dataclass(frozen=True, eq=False)
class Call:
    """What the scheduler and the fleet decide to ask of an actor slot: its process up (READY), an engine of a
    model started (START, `args` as `start_engine` takes them), a shard run (SHARD, its job). The loop hands it
    to the I/O (cluster/schedule/actor_io.py `send`), which makes the remote call."""
    kind: ActorCall
    slot: Slot
    job: Job | None = None
    args: tuple = ()


class InFlight(dict):
    """The scheduler's calls in flight, {ref: (what the call is for, its job or None, its slot)}: the refs are
    what `ray.wait` waits on."""

    def add(self, ref, call: ActorCall, slot: Slot, job: Job | None = None) -> None:
        self[ref] = (call, job, slot)

    def shards(self, model: str | None = None) -> list[Job]:
        """The jobs of the shards in flight (of `model`)."""
        return [job for call, job, _ in self.values()
                if call == ActorCall.SHARD and (model is None or job.shard.model == model)]

    def held_by(self, slots: list[Slot]) -> list[Job]:
        """The jobs of the shards in flight on `slots`."""
        return [job for call, job, slot in self.values() if call == ActorCall.SHARD and slot in slots]


@dataclass
class SchedulerEvents:
    """What the scheduler reports; the sink and progress reporting subscribe."""
    on_result: Callable[[Job, Any, dict], None]  # (job, results table, telemetry row)
    on_failed: Callable[[Job], None]  # every attempt failed, or its model's engine could not start
    # a bisected shard's rows, in its order: (its job, the parts' results with error rows, {sample id: error} of
    # the rows that failed alone); None: no bisection, a shard that fails every attempt fails
    on_bisected: Callable[[Job, Any, dict], None] | None = None
    on_bisecting: Callable[[Job], None] = lambda job: None  # a shard is about to be bisected
    # a shard cut in parts at its model's tail (cluster/schedule/tail_split.py): (its job, its parts' results in its order);
    # None: no tail splitting
    on_split: Callable[[Job, Any], None] | None = None
    on_attempt_failed: Callable[[Job, str], None] = lambda job, error: None
    on_actor_started: Callable[[dict], None] = lambda row: None  # an engine started: its telemetry row
    # a model given up: no engine of it could start (model name, the engine's error); its shards fail
    on_model_failed: Callable[[str, str], None] = lambda model, error: None
    on_dispatched: Callable[[Job], None] = lambda job: None  # sent to an actor; comes back as one of the above
    on_actor_lost: Callable[[str], None] = lambda line: None  # an actor (or a node's actors) died: one line, said
    # (the SweepScheduler) at least every TICK_S (cluster/schedule/scheduler.py) while it runs
    on_tick: Callable[[Any], None] = lambda scheduler: None


def first_line(error: BaseException) -> str:
    """The error's type and the last line of its message (Ray's put the cause last), at most 2000 characters."""
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else text}"[:2000]


def node_of(ready: dict) -> tuple[str, str] | None:
    """(node id, node IP) of an actor, from what its `ready` call answered; None where it did not say."""
    return (ready["node_id"], ready.get("node_ip") or "?") if ready.get("node_id") else None


def lost_node(error: BaseException, node: tuple[str, str] | None,
              unreachable: bool = False) -> tuple[str, str, str] | None:
    """(node id, node IP, what became of its actors) where an actor's death is its node's: Ray says its node
    died, or its actor is unreachable (ActorUnavailableError: its process cannot be reached while Ray still
    counts it alive; a process that dies on a live node is an ActorDiedError at once). `node`: where the actor
    ran, if known. None for any other death."""
    text = str(error)
    died = re.search(r"its node has died\. Node Id: ([0-9a-f]+)", text)
    if died is not None:
        ip = re.search(r"^\s*ip: (\S+)", text, re.M)
        return died.group(1), ip.group(1) if ip else node[1] if node else "?", "gone"
    if unreachable and node is not None:
        return node[0], node[1], "unreachable"
    return None


def lost_line(numbers: list[int], node: tuple[str, str, str] | None, error: str, held: list[Job],
              max_attempts: int) -> str:
    """The driver's one line for actors lost at once (all of the sweep's actors on a lost node, or one actor):
    which, and what becomes of the shards they held (retried elsewhere, or failed at their last attempt)."""
    actors = f"actor(s) {', '.join(str(n) for n in sorted(numbers))}"
    last = sum(job.attempt >= max_attempts for job in held)
    fate = f"{len(held) - last} shard(s) sent to other actors" + (f", {last} failed at their last attempt" if last else "")
    if node is not None:
        return f"[raysweep] node {node[1]} ({node[0][:8]}) lost: {actors} {node[2]}, {fate}"
    return f"[raysweep] {actors} died ({error[:300]}): {fate}"
