"""One scheduler over the whole sweep (docs/design.md, Actors and engines): every model's shards on one set of actors.

1. Actors are GPU shares, started before their model is chosen, so their imports overlap the driver's checks
   and planning; as many as the models with work left allow (each model's `actors.count` is a per-model
   maximum), bounded by what the cluster holds. A model gets an engine once it passed its checks.
2. An actor whose imports are done gets the model with the most samples left per actor below its maximum.
   When its model's work is done, it gets another (a counted model change): one below its maximum, else,
   once planning is over, one whose waiting shards outnumber what its actors hold (a tail); else it goes.
3. Within a model, shards go by engine profile: an actor changes profile (an engine restart) only when none of
   its own are left and nothing is in flight; it is kept `depth` shards deep, so a streaming engine never waits.
4. Shards arrive while planning goes on (`feed`): a task's shards go out as soon as it is planned.
5. Failures: a shard that raises is retried, up to `max_attempts`; one that raises the same error twice, or
   on its last attempt, is bisected (cluster/schedule/bisection.py) down to the rows that fail alone. An actor
   that dies is replaced and its shards retried (never bisected), said in one line (a lost node's actors all in
   one: work.py lost_node). An engine that cannot start (it raised, or did not answer in time:
   cluster/schedule/engine_starts.py) fails its model's shards with its own error, in one line, and the other
   models go on. A pooled shard whose replica died is retried as on an actor's death; one whose pool went away
   goes back to its queue. Engines sharing a GPU start together, each KV cache sized from its share
   (`RAYSWEEP_SHARED_GPU_START=serial`: one at a time, vLLM measuring free memory).

What it moves (Job, ModelWork, Slot) and the events it reports (SchedulerEvents): cluster/schedule/work.py.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.contracts.shard import ActorState
from cluster.schedule.bisection import DIED, Bisection, Piece, should_bisect
from cluster.schedule.engine_starts import ActorStartError, start_timeout_s, take_overdue, timed_out_line
from cluster.schedule.kept import close_actors
from cluster.schedule.tail_split import TailClock, TailSplit, cut_waiting
from cluster.schedule.work import (ENGINE_HELD, FREE, POOLED, SERVING, UP, Job, ModelWork, SchedulerEvents, Slot,
                                   first_line as _first_line, lost_line, lost_node, node_of)


TICK_S = 1.0  # the longest the loop waits for a result before it reports in (progress lines)


class SweepScheduler:
    def __init__(self, spawn: Callable[[int, float, Any], Any], events: SchedulerEvents,
                 capacity: int | None | dict = None, max_attempts: int = 3, start_one_by_one: bool = False,
                 keep: Callable[[list[Slot]], list[Slot]] | None = None):
        """`spawn(number, requested_at, shape)` starts an actor of a model shape; `capacity`: how many actors
        the cluster holds at once (None: no bound), or {shape: that} where models differ in shape. `keep(slots)`
        takes the actors a later sweep may run on, engines up, and returns the rest (cluster/schedule/kept.py)."""
        bounds = capacity.values() if isinstance(capacity, dict) else [capacity]
        if max_attempts < 1 or any(c is not None and c < 1 for c in bounds):
            raise ValueError("max_attempts and capacity must be >= 1")
        self.spawn, self.events, self.capacity, self.max_attempts = spawn, events, capacity, max_attempts
        self.start_one_by_one = start_one_by_one  # engines sharing a GPU must not size their memory at once
        self.keep = keep
        self.start_timeout_s = start_timeout_s()  # cluster/schedule/engine_starts.py
        self.models: dict[str, ModelWork] = {}
        self.slots: list[Slot] = []
        self.inflight: dict[Any, tuple[str, Job | None, Slot]] = {}
        self.actors_started = self.actor_deaths = self.model_changes = 0
        self.pool_lost: list[str] = []  # models whose pool went away during the sweep
        self.nodes_lost: set[str] = set()  # nodes whose actors died with them (or became unreachable)
        self._most_slots = 1
        self.tail = TailClock()  # each actor's first and last shard: the run's tail idle
        self.tail_splits = 0  # shards cut in parts at their model's tail

    # -- what planning hands in ------------------------------------------------------------------------
    def add_model(self, model: ModelWork) -> None:
        self.models[model.name] = model

    def add_pool(self, model: str, handle: Any, depth: int, replicas: int = 1) -> None:
        """Send `model`'s shards to the engine pool through `handle` (its `run_shard.remote`, as an actor's),
        `depth` at a time, over at most `replicas` replicas; no actor starts for it unless the pool goes away
        (a shard raises PoolGone)."""
        work = self.models[model]
        own = work.max_actors or next((s.actors for s in self.slots if s.state == POOLED and s.model == model), 0)
        self.slots.append(Slot(handle=handle, number=-1, state=POOLED, model=model, depth=depth,
                                actors=own, replicas=replicas))
        work.max_actors = 0

    def add_jobs(self, jobs: list[Job]) -> None:
        for job in jobs:
            model = self.models[job.shard.model]
            if model.failed:
                self._fail(job, model.failed)
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
                self._grow(planning)
                self._assign(planning)
                self._dispatch(planning)
                if not planning and not self._work_left():
                    return
                if not self.inflight:
                    if not planning and not self.slots:
                        raise RuntimeError("shards are left but no actor can be started for them")
                    continue
                self.events.on_tick(self)
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=0.05 if planning else TICK_S)
                for ref in ready:
                    kind, job, slot = self.inflight.pop(ref)
                    self._collect(ref, kind, job, slot)
                for slot in take_overdue(self.inflight, self.start_timeout_s):  # a hung start: its actor goes
                    self._model_failed(slot, timed_out_line(self.start_timeout_s))
                    self.slots.remove(slot)
                    ray.kill(slot.handle)
        finally:
            self._shutdown()

    def state_counts(self) -> dict[str, int]:
        """Actors by state (importing, idle, starting, running), for progress lines."""
        counts: dict[str, int] = {}
        for slot in self.slots:
            counts[slot.state.value] = counts.get(slot.state.value, 0) + 1
        return counts

    def _work_left(self) -> bool:
        return any(m and not m.failed for m in self.models.values()) or any(
            kind == "shard" for kind, _, _ in self.inflight.values())

    def _wanted(self, planning: bool) -> dict:
        """{shape: actors} the work left can use: per model up to its maximum (while it plans, its maximum),
        bounded per shape by what the cluster holds."""
        wanted: dict = {}
        for m in self.models.values():
            if m.failed:
                continue
            shards = sum(len(q) for q in m.queues.values()) + sum(
                1 for kind, job, _ in self.inflight.values() if kind == "shard" and job.shard.model == m.name)
            wanted[m.shape] = wanted.get(m.shape, 0) + (m.max_actors if planning else min(m.max_actors, shards))
        for shape, count in wanted.items():
            bound = self.capacity.get(shape) if isinstance(self.capacity, dict) else self.capacity
            wanted[shape] = count if bound is None else min(count, bound)
        return wanted

    def _grow(self, planning: bool) -> None:
        wanted = self._wanted(planning)
        self._most_slots = max(self._most_slots, sum(wanted.values()))
        for shape, count in wanted.items():
            while sum(s.state != POOLED and s.shape == shape for s in self.slots) < count:
                number = self.actors_started
                self.actors_started += 1
                slot = Slot(handle=self.spawn(number, time.time(), shape), number=number, shape=shape)
                self.slots.append(slot)
                self.inflight[slot.handle.ready.remote()] = ("ready", None, slot)

    def _assign(self, planning: bool) -> None:
        done = []  # actors no model needs any more
        for slot in list(self.slots):
            if slot.state not in UP or slot.inflight:
                continue
            current = self.models.get(slot.model)
            if current is not None and current and not current.failed:
                continue  # its model still has work
            model = self._next_model(slot) or (None if planning else self._model_to_help(slot))
            sizing = self.start_one_by_one and any(s.state == ActorState.STARTING for s in self.slots)
            if model is None:
                # no model needs it any more; on a shared GPU not while another engine sizes its memory:
                # vLLM's profiling fails when a neighbour frees memory meanwhile (seen on an H100); and not
                # while its model's last shards run elsewhere: one that fails comes back (a retry, a split's
                # whole shard, bisection's parts) to this warm engine rather than to a new one's start
                if not planning and not sizing and not self._in_flight(slot.model):
                    done.append(slot)
                continue
            if sizing:
                continue  # another engine on a shared GPU is sizing its memory
            if current is not None:
                current.assigned -= 1
                self.model_changes += 1
            model.assigned += 1
            slot.state, slot.model, slot.profile, slot.start_at = ActorState.STARTING, model.name, None, time.monotonic()
            self.inflight[model.start(slot.handle, time.time())] = ("start", None, slot)
        for slot in done:  # their engines close at once, not one after another (about 1 s each on a GPU)
            self.slots.remove(slot)
            if slot.model is not None:
                self.models[slot.model].assigned -= 1
        if done:  # not on the loop's every pass
            self._shutdown_slots(done)

    def _in_flight(self, model: str | None) -> bool:
        """Whether a shard of `model` is running on some actor."""
        return any(kind == "shard" and job.shard.model == model for kind, job, _ in self.inflight.values())

    def _next_model(self, slot: Slot) -> ModelWork | None:
        """The model with the most samples left per actor, among those with work below their maximum."""
        candidates = [m for m in self.models.values() if m and not m.failed and m.start is not None
                      and m.assigned < m.max_actors and m.name != slot.model and m.name not in slot.refused
                      and m.shape == slot.shape]
        return max(candidates, key=lambda m: m.samples_left() / (m.assigned + 1), default=None)

    def _model_to_help(self, slot: Slot) -> ModelWork | None:
        """For an actor no model needs below its maximum (its own model done): the model of its shape with the
        most shards waiting, where more wait than its actors hold at once, so a whole round of them would
        still be waiting for those actors. Above `actors.count` for that model, but no new actor: one that
        would idle (or be released) runs the tail of another model instead."""
        def held(m: ModelWork) -> int:
            return sum(s.depth or m.depth for s in self.slots if s.model == m.name and s.state != ActorState.IMPORTING)

        candidates = [m for m in self.models.values() if m and not m.failed and m.start is not None
                      and m.max_actors > 0 and m.name != slot.model and m.name not in slot.refused
                      and m.shape == slot.shape and m.waiting() > held(m)]
        return max(candidates, key=ModelWork.waiting, default=None)

    def _dispatch(self, planning: bool = False) -> None:
        for slot in self.slots:
            if slot.state not in (ActorState.RUNNING, POOLED):
                continue
            model = self.models[slot.model]
            full = slot.inflight >= (slot.depth or model.depth)
            if not full and model and not planning and self.events.on_split is not None:
                self._split_tail(model)  # only where this slot is about to take a shard: not on every tick
            while slot.inflight < (slot.depth or model.depth) and (job := model.take(slot, self.slots)) is not None:
                self.inflight[slot.handle.run_shard.remote(job.shard, job.task, job.attempt)] = ("shard", job, slot)
                slot.inflight += 1
                slot.profile = job.shard.profile
                if slot.state != POOLED:
                    self.tail.sent(slot.number, slot.shape.num_gpus if getattr(slot.shape, "num_gpus", 0) else 1.0)
                self.events.on_dispatched(job)

    def _split_tail(self, model: ModelWork) -> None:
        """Cut the model's largest waiting shards in halves while fewer wait than its actors hold at once, or
        while one is larger than the model's fair share of an actor's slot (cluster/schedule/tail_split.py,
        step 1). The actors still importing or starting their engine for the model count: the first engine up
        must not take the work of the others; the pool's replicas count by the shards the pool holds at once."""
        serving = [s for s in self.slots if s.model == model.name and s.state in SERVING]
        coming = min(model.max_actors - model.assigned,  # actors still importing, or idle, that it will get
                     sum(s.model is None and s.shape == model.shape and s.state in FREE
                         for s in self.slots))
        holds = sum(s.depth or model.depth for s in serving) + max(coming, 0) * model.depth
        if holds < 2 or sum(s.replicas or 1 for s in serving) + max(coming, 0) < 2:
            return  # one actor (or one pool replica) takes every shard anyway
        in_flight = sum(job.shard.n_samples for kind, job, _ in self.inflight.values()
                        if kind == "shard" and job.shard.model == model.name)
        self.tail_splits += cut_waiting(model.queues, holds, in_flight)

    # -- what comes back --------------------------------------------------------------------------------
    def _collect(self, ref, kind: str, job: Job | None, slot: Slot) -> None:
        if kind == "shard":
            slot.inflight -= 1
            if slot.state != POOLED:
                self.tail.back(slot.number)
        try:
            value = ray.get(ref)
        except RayActorError as e:
            if kind == "ready" and e.actor_init_failed:  # its imports raised: every actor's would
                raise ActorStartError(_first_line(e)) from e
            self._lost(slot, e, job)  # the process died (killed, OOM, node lost): replaced by _grow
            if job is not None:
                self._retry(job, f"{DIED}{_first_line(e)}", died=True)
            return
        except RayTaskError as e:
            if kind == "start":  # the engine raised while starting: this model cannot run
                self._model_failed(slot, f"engine did not start: {_first_line(e.cause or e)}")
            elif kind == "shard" and slot.state == POOLED and type(e.cause).__name__ == "PoolGone":
                self._unpool(slot, job)
            elif kind == "shard" and slot.state == POOLED and type(e.cause).__name__ == "ReplicaDied":
                self._retry(job, _first_line(e.cause), died=True)  # as an actor's death: retried, never bisected
            elif kind == "shard":
                self._retry(job, _first_line(e.cause if e.cause is not None else e))
            else:
                raise
            return
        if kind == "ready":
            if value.get("refusal"):  # the actor's GPU cannot do what the spec asks (reproducible: true)
                raise ActorStartError(value["refusal"])
            slot.state, slot.node = ActorState.IDLE, node_of(value)
        elif kind == "start":
            slot.state = ActorState.RUNNING
            self.events.on_actor_started(value)
        else:
            self.events.on_result(job, *value)
            if job.piece is not None:
                self._bisect_step(job.piece.bisection, job.piece.bisection.part_ran(job.piece, value[0]))

    def _model_failed(self, slot: Slot, error: str) -> None:
        """An engine that raised while starting. If another actor runs the same model, only this actor
        gives it up (its GPU share may be what failed); otherwise the model's shards fail with the error."""
        model = self.models[slot.model]
        model.assigned -= 1
        slot.refused.add(model.name)
        slot.state, slot.model = ActorState.IDLE, None
        if any(s.model == model.name and s.state == ActorState.RUNNING for s in self.slots):
            return
        model.failed = error
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
                bisection.abandon(model.failed)
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

    def _unpool(self, slot: Slot, job: Job | None) -> None:
        """The pool went away (`raysweep pool down --force`), or its client died (no `job`): the shard goes back
        to its queue, its attempt not counted, and the model gets its own actors from now on."""
        if job is not None:
            self.models[job.shard.model].add(job, first=True)
        if slot in self.slots:
            self.slots.remove(slot)
            self.models[slot.model].max_actors = slot.actors
            self.pool_lost.append(slot.model)

    def _lost(self, slot: Slot, error: RayActorError, job: Job | None = None) -> None:
        if slot not in self.slots:
            return  # its death was already seen through another of its calls (or its node's loss)
        if slot.state == POOLED:  # the sweep's pool client died: the model runs on actors of its own
            return self._unpool(slot, None)
        node = lost_node(error, slot.node)  # a node lost takes every actor of the sweep there: said in one line
        gone = [s for s in self.slots if s is slot or node and s.state != POOLED and s.node and s.node[0] == node[0]]
        held = [j for kind, j, s in self.inflight.values() if kind == "shard" and s in gone] + [job] * (job is not None)
        if node is None or node[0] not in self.nodes_lost:  # a replacement that had started there: said already
            self.events.on_actor_lost(lost_line([s.number for s in gone], node, _first_line(error), held, self.max_attempts))
        self.nodes_lost |= {node[0]} if node else set()
        for gone_slot in gone:  # their shards come back one by one as failed calls, and are retried (_collect)
            self.slots.remove(gone_slot)
            if gone_slot.model is not None and gone_slot.state in ENGINE_HELD:
                self.models[gone_slot.model].assigned -= 1
            self.tail.died(gone_slot.number)
            self.actor_deaths += 1
            ray.kill(gone_slot.handle)
        if self.actor_deaths > self._most_slots * self.max_attempts:
            raise RuntimeError(f"{self.actor_deaths} actors died; the last: {_first_line(error)}") from error

    def _shutdown(self) -> None:
        slots, self.slots = [s for s in self.slots if s.state != POOLED], []
        self._shutdown_slots(slots)

    def _shutdown_slots(self, slots: list[Slot]) -> None:
        """Those `keep` does not take: engines closed first, then the actors killed (cluster/schedule/kept.py)."""
        slots = self.keep(slots) if self.keep is not None else slots
        close_actors([s.handle for s in slots if s.state in UP], [s.handle for s in slots])
