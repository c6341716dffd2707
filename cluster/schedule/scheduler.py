"""One scheduler over the whole sweep (docs/design.md, Actors and engines): every model's shards on one set of
actors (cluster/schedule/fleet.py starts them, gives them models and replaces them); here, what goes to each, and
what is done with what comes back.

1. The loop: what planning produced is taken in (`feed`: a task's shards go out as soon as it is planned), the
   fleet grows and gives its actors models, shards are dispatched, and the first call to come back is collected.
   Growing, assigning and dispatching return the calls they decided on (cluster/schedule/work.py Call); the loop
   hands each to the I/O (cluster/schedule/actor_io.py), which makes it, and collects each answer as a typed
   outcome.
2. Dispatch: within a model, shards go by engine profile (cluster/schedule/work.py ModelWork.take): an actor
   changes profile (an engine restart) only when none of its own are left and nothing is in flight; it is kept
   `depth` shards deep, so a streaming engine never waits. Once planning is over, a model's last shards are cut
   smaller where its actors would otherwise idle (cluster/schedule/tail_split.py).
3. Failures: a shard that raises is retried, up to `max_attempts`; one that raises the same error twice, or
   on its last attempt, is bisected (cluster/schedule/bisection.py) down to the rows that fail alone. A shard
   whose actor died is retried (never bisected). An engine that cannot start (it raised, or did not answer in
   time: cluster/schedule/engine_starts.py) fails its model's shards with its own error, in one line, and the
   other models go on. A shard whose engine died where the engines lent to the sweep stand (a pool replica) is
   retried as on an actor's death; one whose lent engines went away goes back to its queue, and its model to
   actors of the sweep's own. Engines sharing a GPU start together, each KV cache sized from its share
   (`RAYSWEEP_SHARED_GPU_START=serial`: one at a time, vLLM measuring free memory).

What it moves (Job, ModelWork, Slot, InFlight) and the events it reports (SchedulerEvents): cluster/schedule/work.py.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from cluster.contracts.shard import ActorCall, ActorState
from cluster.schedule.actor_io import ActorLost, CallRaised, EnginesGone, Outcome, RayIO
from cluster.schedule.bisection import DIED, Bisection, Piece, should_bisect
from cluster.schedule.engine_starts import ActorStartError, start_timeout_s, take_overdue, timed_out_line
from cluster.schedule.fleet import Fleet
from cluster.schedule.tail_split import TailClock, TailSplit, split_tail
from cluster.schedule.work import (Call, InFlight, Job, ModelWork, SchedulerEvents, Slot, advance,
                                   first_line as _first_line, node_of)


TICK_S = 1.0  # the longest the loop waits for a result before it reports in (progress lines)


class SweepScheduler:
    def __init__(self, spawn: Callable[[int, float, Any], Any], events: SchedulerEvents,
                 capacity: int | None | dict = None, max_attempts: int = 3, start_one_by_one: bool = False,
                 keep: Callable[[list[Slot]], list[Slot]] | None = None, io=None):
        """`spawn(number, requested_at, shape)` starts an actor of a model shape; `capacity`: how many actors
        the cluster holds at once (None: no bound), or {shape: that} where models differ in shape. `keep(slots)`
        takes the actors a later sweep may run on, engines up, and returns the rest (cluster/schedule/fleet.py
        KeptActors). `io`: the waits, answers and kills (cluster/schedule/actor_io.py; default: Ray's)."""
        bounds = capacity.values() if isinstance(capacity, dict) else [capacity]
        if max_attempts < 1 or any(c is not None and c < 1 for c in bounds):
            raise ValueError("max_attempts and capacity must be >= 1")
        self.events, self.max_attempts, self.io = events, max_attempts, io or RayIO()
        self.start_timeout_s = start_timeout_s()  # cluster/schedule/engine_starts.py
        self.models: dict[str, ModelWork] = {}
        self.inflight = InFlight()
        self.tail = TailClock()  # each actor's first and last shard: the run's tail idle
        self.tail_splits = 0  # shards cut in parts at their model's tail
        self.fleet = Fleet(spawn, self.models, self.inflight, self.tail, capacity, max_attempts, start_one_by_one,
                           keep, events.on_actor_lost, self.io)

    # -- what planning hands in ------------------------------------------------------------------------
    def add_model(self, model: ModelWork) -> None:
        self.models[model.name] = model

    def add_jobs(self, jobs: list[Job]) -> None:
        for job in jobs:
            model = self.models[job.shard.model]
            if model.failed:
                self._fail(job, model.error)
            else:
                model.add(job)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self, feed: Callable[[float], bool]) -> None:
        """`feed(timeout_s)` adds what planning produced (waiting up to timeout_s for it) and returns
        True once planning is over."""
        planning = True
        try:
            while True:
                if planning:
                    planning = not feed(0.0 if self.inflight else 0.05)
                self._send(self.fleet.grow(planning))
                self._send(self.fleet.assign(planning))
                self._send(self._dispatch(planning))
                if not planning and not self._work_left():
                    return
                if not self.inflight:
                    if not planning and not self.fleet.slots:
                        raise RuntimeError("shards are left but no actor can be started for them")
                    continue
                self.events.on_tick(self)
                for ref in self.io.wait(list(self.inflight), 0.05 if planning else TICK_S):
                    kind, job, slot = self.inflight.pop(ref)
                    self._collect(kind, job, slot, self.io.outcome(ref))
                for slot in take_overdue(self.inflight, self.start_timeout_s,  # a hung start: its actor goes
                                         answered=self.io.answered):
                    self._engine_failed(slot, timed_out_line(self.start_timeout_s))
                    self.fleet.stop(slot)
        finally:
            self.fleet.shut_down()

    def _send(self, calls: Iterable[Call]) -> None:
        """Make each call decided on (one at a time: a call is in flight before the next is decided)."""
        for call in calls:
            self.inflight.add(self.io.send(call), call.kind, call.slot, call.job)

    def _work_left(self) -> bool:
        return any(m and not m.failed for m in self.models.values()) or bool(self.inflight.shards())

    # -- what goes out ----------------------------------------------------------------------------------
    def _dispatch(self, planning: bool = False) -> Iterator[Call]:
        """The shards to send, one SHARD call at a time, each slot kept its depth deep."""
        slots = self.fleet.slots
        for slot in slots:
            if slot.state is not ActorState.RUNNING:
                continue
            model = self.models[slot.model]
            full = slot.inflight >= (slot.depth or model.depth)
            if not full and model and not planning and self.events.on_split is not None:
                self._split_tail(model)  # only where this slot is about to take a shard: not on every tick
            while slot.inflight < (slot.depth or model.depth) and (job := model.take(slot, slots)) is not None:
                yield Call(ActorCall.SHARD, slot, job, (job.shard, job.task, job.attempt))
                slot.inflight += 1
                slot.profile = job.shard.profile
                self.fleet.sent(slot)
                self.events.on_dispatched(job)

    def _split_tail(self, model: ModelWork) -> None:
        """Cut the model's largest waiting shards in halves while fewer wait than its slots hold at once, or
        while one is larger than the model's fair share of a slot (cluster/schedule/tail_split.py, step 1)."""
        in_flight = sum(job.shard.n_samples for job in self.inflight.shards(model.name))
        self.tail_splits += split_tail(model, self.fleet.slots, in_flight)

    # -- what comes back --------------------------------------------------------------------------------
    def _collect(self, kind: ActorCall, job: Job | None, slot: Slot, outcome: Outcome) -> None:
        """What a call's answer (or its failure, as a typed outcome) changes."""
        if kind == ActorCall.SHARD:
            slot.inflight -= 1
            self.fleet.back(slot)
        if isinstance(outcome, ActorLost):
            if kind == ActorCall.READY and outcome.init_failed:  # its imports raised: every actor's would
                raise ActorStartError(_first_line(outcome.error)) from outcome.error
            self.fleet.lose(slot, outcome.error, job, outcome.unreachable)  # it died (killed, OOM, node lost): replaced as the fleet grows
            if job is not None:
                self._retry(job, f"{DIED}{_first_line(outcome.error)}", died=True)
            return
        if isinstance(outcome, EnginesGone):  # the shard back to its queue, its attempt not counted
            self.models[job.shard.model].add(job, first=True)
            self.fleet.unlend(slot)
            return
        if isinstance(outcome, CallRaised):
            if kind == ActorCall.START:  # the engine raised while starting: this model cannot run
                self._engine_failed(slot, f"engine did not start: {_first_line(outcome.raised)}")
            elif kind == ActorCall.SHARD and outcome.died:  # as an actor's death: retried, never bisected
                self._retry(job, _first_line(outcome.raised), died=True)
            elif kind == ActorCall.SHARD:
                self._retry(job, _first_line(outcome.raised))
            else:
                raise outcome.error
            return
        value = outcome.value
        if kind == ActorCall.READY:
            if value.get("refusal"):  # the actor's GPU cannot do what the spec asks (reproducible: true)
                raise ActorStartError(value["refusal"])
            advance(slot, ActorState.IDLE)
            slot.node = node_of(value)
        elif kind == ActorCall.START:
            advance(slot, ActorState.RUNNING)
            self.events.on_actor_started(value)
        else:
            self.events.on_result(job, *value)
            if job.piece is not None:
                self._bisect_step(job.piece.bisection, job.piece.bisection.part_ran(job.piece, value[0]))

    def _engine_failed(self, slot: Slot, error: str) -> None:
        """An engine that raised while starting, or did not start in time. If another actor runs the same model,
        only this actor gives it up (its GPU share may be what failed); otherwise the model's shards fail with
        the error."""
        model = self.models[slot.model]
        self.fleet.give_up(slot)
        if self.fleet.running(model.name):
            return
        model.give_up(error)
        self.events.on_model_failed(model.name, error)
        for queue in model.queues.values():
            while queue:
                self._fail(queue.popleft(), error)

    def _fail(self, job: Job, error: str | None = None) -> None:
        """No more attempts for `job`: its shard fails (a part's failure ends its shard's bisection)."""
        if error is not None:
            job.errors.append(error)
        if job.piece is None:
            self.events.on_failed(job)
        else:
            job.piece.bisection.abandon(job.errors[-1])
            self._bisect_step(job.piece.bisection, [])

    def _retry(self, job: Job, error: str, died: bool = False) -> None:
        job.errors.append(error)
        self.events.on_attempt_failed(job, error)
        if job.piece is not None and job.piece.bisection.gave_up:
            return  # its split or bisection already ended (another part raised): the part is not run again
        if job.piece is not None and not died and isinstance(job.piece.bisection, TailSplit):
            self._unsplit(job.piece.bisection, error)
        elif job.piece is not None and not died:  # a part is not tried again: its failure is known to repeat
            self._bisect_step(job.piece.bisection, job.piece.bisection.part_failed(job.piece, error))
        elif self.events.on_bisected is not None and should_bisect(job, died, self.max_attempts):
            self.events.on_bisecting(job)
            bisection = Bisection(job)
            self._bisect_step(bisection, bisection.start())
        elif job.attempt >= self.max_attempts:
            self._fail(job)
        else:
            job.attempt += 1
            self.models[job.shard.model].add(job, first=True)

    def _unsplit(self, split: TailSplit, error: str) -> None:
        """A part of a shard cut at the tail raised: the split ends (its other parts' results, in flight or
        back, are dropped; its waiting parts leave the queue) and the whole shard has a failed attempt."""
        split.abandon(error)
        split.reported = True
        model = self.models[split.job.shard.model]
        for queue in model.queues.values():
            for job in [j for j in queue if j.piece is not None and j.piece.bisection is split]:
                queue.remove(job)
        self._retry(split.job, error)

    def _bisect_step(self, bisection: Bisection | TailSplit, parts: list[Piece]) -> None:
        """Queue a bisection's next parts (first: they finish a shard already started); once it is settled,
        report its shard, once: committed with its error rows, or failed whole. A shard cut at the tail
        (TailSplit) is reported the same way once its parts are back."""
        model = self.models[bisection.job.shard.model]
        for piece in reversed(parts):
            if model.failed:
                bisection.abandon(model.error)
                break
            model.add(Job(piece.shard, bisection.job.task, piece=piece), first=True)
        if not bisection.settled or bisection.reported:
            return
        bisection.reported = True
        if bisection.gave_up:
            bisection.job.errors.append(bisection.gave_up)
            self.events.on_failed(bisection.job)
        elif isinstance(bisection, TailSplit):
            self.events.on_split(bisection.job, bisection.table())
        else:
            self.events.on_bisected(bisection.job, bisection.table(), bisection.row_errors())
