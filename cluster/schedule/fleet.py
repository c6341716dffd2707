"""The sweep's actors while it runs (docs/design.md, Actors and engines): the slots the scheduler
(cluster/schedule/scheduler.py) hands shards to, started, given models, replaced and released here.

1. Actors are GPU shares, started before their model is chosen, so their imports overlap the driver's checks
   and planning; as many as the models with work left allow (each model's `actors.count` is a per-model
   maximum), bounded by what the cluster holds of their shape (`grow`).
2. An actor whose imports are done gets the model with the most samples left per actor below its maximum.
   When its model's work is done, it gets another (a counted model change): one below its maximum, else,
   once planning is over, one whose waiting shards outnumber what its actors hold (a tail); else it is
   released (`assign`). Engines sharing a GPU start one at a time where `start_one_by_one`.
3. Engines lent to the sweep (kept from an earlier sweep, or the pool's: cluster/schedule/engine_sources.py) are
   slots of their own, running from the start (`lend`): no actor starts for their model unless they go away
   (`unlend`); then the model gets its own actors again.
4. An engine that cannot start gives its model up on that actor (`give_up`); an actor that dies is taken
   out, with every actor of the sweep on its node where the node was lost, said in one line (`lose`): `grow`
   replaces them. At the end the engines `keep` takes stay up; the others close, then their actors are killed.
5. Kept actors (`KeptActors`): engines that outlive one sweep, for a process that runs several sweeps of the
   same model in a row: `raysweep lm-eval --model raysweep` runs one sweep per request type lm-eval asks for
   (loglikelihood, then generate_until, ...), and each would otherwise start its engines again (tens of
   seconds each on a GPU). The first sweep's `keep` takes the actors it no longer needs whose engine runs; a
   later sweep of a model with the same path and engine arguments has them lent to it
   (cluster/schedule/engine_sources.py); should one have died, the model gets actors of its own again. `close`
   ends them, as a sweep ends the actors it does not keep (cluster/schedule/actor_io.py `close`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from cluster.contracts.shard import ActorCall, ActorState
from cluster.contracts.spec import ModelSpec
from cluster.schedule.actor_io import RayIO
from cluster.schedule.tail_split import TailClock
from cluster.schedule.work import (ENGINE_HELD, UP, Call, InFlight, ModelState, ModelWork, Slot, advance,
                                   first_line, lost_line, lost_node)


class KeptActors:
    def __init__(self) -> None:
        self._actors: list[tuple[ModelSpec, object]] = []  # (the model its engine runs, the actor's handle)

    def keeper(self, models: dict[str, ModelSpec], failed):
        """SweepScheduler's `keep` for a sweep of `models` (by name): it takes each actor whose engine runs a
        model that did not fail (`failed(name)`) and has no shard in flight, and returns the others."""
        def keep(slots: list) -> list:
            closing = []
            for slot in slots:
                if slot.state == ActorState.RUNNING and slot.model and not failed(slot.model) and not slot.inflight:
                    self._actors.append((models[slot.model], slot.handle))
                else:
                    closing.append(slot)
            return closing
        return keep

    def running(self, model: ModelSpec) -> list:
        """The handles of the kept actors whose engine runs `model` (same name, path and engine arguments)."""
        return [handle for kept, handle in self._actors if kept == model]

    def close(self) -> None:
        actors, self._actors = [handle for _, handle in self._actors], []
        RayIO().close(actors, actors)


class Fleet:
    def __init__(self, spawn: Callable[[int, float, Any], Any], models: dict[str, ModelWork], inflight: InFlight,
                 tail: TailClock, capacity: int | None | dict, max_attempts: int, start_one_by_one: bool = False,
                 keep: Callable[[list[Slot]], list[Slot]] | None = None, on_lost: Callable[[str], None] = print,
                 io=None):
        """`spawn(number, requested_at, shape)` starts an actor; `models` and `inflight` are the scheduler's;
        `capacity`: how many actors the cluster holds at once (None: no bound), or {shape: that}. `keep(slots)`
        takes the actors a later sweep may run on (`KeptActors`) and returns the rest. `on_lost`
        says an actor's (or a node's actors') death in one line. `io`: the kills and closes (cluster/schedule/
        actor_io.py; default: Ray's)."""
        self.spawn, self.models, self.inflight, self.tail = spawn, models, inflight, tail
        self.capacity, self.max_attempts, self.keep, self.on_lost = capacity, max_attempts, keep, on_lost
        self.io = io or RayIO()
        self.start_one_by_one = start_one_by_one  # engines sharing a GPU must not size their memory at once
        self.slots: list[Slot] = []
        self.actors_started = self.actor_deaths = self.model_changes = 0
        self.lent_lost: list[str] = []  # models whose lent engines went away during the sweep
        self.nodes_lost: set[str] = set()  # nodes whose actors died with them (or became unreachable)
        self._most_slots = 1

    def lend(self, model: str, handle: Any, depth: int, replicas: int = 1) -> None:
        """Engines up before the sweep run `model`'s shards through `handle` (its `run_shard.remote`, as an
        actor's), `depth` at a time, over at most `replicas` engines; no actor starts for it unless they go away
        (cluster/schedule/actor_io.py EnginesGone, or the handle's actor lost)."""
        work = self.models[model]
        own = work.max_actors or next((s.actors for s in self.slots if s.lent and s.model == model), 0)
        self.slots.append(Slot(handle=handle, number=-1, state=ActorState.RUNNING, model=model, depth=depth,
                               lent=True, actors=own, replicas=replicas))
        work.max_actors = 0

    # -- step 1: started ---------------------------------------------------------------------------------
    def _wanted(self, planning: bool) -> dict:
        """{shape: actors} the work left can use: per model up to its maximum (while it plans, its maximum),
        bounded per shape by what the cluster holds."""
        wanted: dict = {}
        for m in self.models.values():
            if m.failed:
                continue
            shards = m.waiting() + len(self.inflight.shards(m.name))
            wanted[m.shape] = wanted.get(m.shape, 0) + (m.max_actors if planning else min(m.max_actors, shards))
        for shape, count in wanted.items():
            bound = self.capacity.get(shape) if isinstance(self.capacity, dict) else self.capacity
            wanted[shape] = count if bound is None else min(count, bound)
        return wanted

    def grow(self, planning: bool) -> Iterator[Call]:
        """Start the actors the work left can use (`spawn`); the READY call of each, sent as it is yielded."""
        wanted = self._wanted(planning)
        self._most_slots = max(self._most_slots, sum(wanted.values()))
        for shape, count in wanted.items():
            while sum(not s.lent and s.shape == shape for s in self.slots) < count:
                number = self.actors_started
                self.actors_started += 1
                slot = Slot(handle=self.spawn(number, time.time(), shape), number=number, shape=shape)
                self.slots.append(slot)
                yield Call(ActorCall.READY, slot)

    # -- step 2: given a model, another, or released ------------------------------------------------------
    def assign(self, planning: bool) -> Iterator[Call]:
        """Give idle actors a model (each START call sent as it is yielded, before any release below), another
        model, or release them."""
        done = []  # actors no model needs any more
        for slot in list(self.slots):
            if slot.lent or slot.state not in UP or slot.inflight:
                continue  # lent engines serve their one model, and are the lender's to release
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
                if not planning and not sizing and not (slot.model is not None and self.inflight.shards(slot.model)):
                    done.append(slot)
                continue
            if sizing:
                continue  # another engine on a shared GPU is sizing its memory
            if current is not None:
                current.assigned -= 1
                self.model_changes += 1
            model.assigned += 1
            advance(slot, ActorState.STARTING)
            slot.model, slot.profile = model.name, None
            slot.start_at = time.monotonic()
            yield Call(ActorCall.START, slot, args=model.start(time.time()))
        for slot in done:  # their engines close at once, not one after another (about 1 s each on a GPU)
            self.slots.remove(slot)
            if slot.model is not None:
                self.models[slot.model].assigned -= 1
        if done:  # not on the loop's every pass
            self._release(done)

    def _next_model(self, slot: Slot) -> ModelWork | None:
        """The model with the most samples left per actor, among those with work below their maximum; of those
        with as many, another checkpoint of the actor's model first (its engine loads the weights alone)."""
        candidates = [m for m in self.models.values() if m and m.state is ModelState.READY
                      and m.assigned < m.max_actors and m.name != slot.model and m.name not in slot.refused
                      and m.shape == slot.shape]
        current = self.models.get(slot.model)
        family = current.family if current is not None else None
        return max(candidates, key=lambda m: (m.samples_left() / (m.assigned + 1),
                                              family is not None and m.family == family), default=None)

    def _model_to_help(self, slot: Slot) -> ModelWork | None:
        """For an actor no model needs below its maximum (its own model done): the model of its shape with the
        most shards waiting, where more wait than its actors hold at once, so a whole round of them would
        still be waiting for those actors. Above `actors.count` for that model, but no new actor: one that
        would idle (or be released) runs the tail of another model instead."""
        def held(m: ModelWork) -> int:
            return sum(s.depth or m.depth for s in self.slots if s.model == m.name and s.state != ActorState.IMPORTING)

        candidates = [m for m in self.models.values() if m and m.state is ModelState.READY
                      and m.max_actors > 0 and m.name != slot.model and m.name not in slot.refused
                      and m.shape == slot.shape and m.waiting() > held(m)]
        return max(candidates, key=ModelWork.waiting, default=None)

    # -- step 3 and 4: what goes wrong ---------------------------------------------------------------------
    def give_up(self, slot: Slot) -> None:
        """An engine that raised while starting (or did not answer in time): its actor gives the model up, for
        good, and is idle for another."""
        self.models[slot.model].assigned -= 1
        slot.refused.add(slot.model)
        advance(slot, ActorState.IDLE)
        slot.model = None

    def running(self, model: str) -> bool:
        """Whether some actor's engine for `model` is up."""
        return any(s.model == model and s.state == ActorState.RUNNING for s in self.slots)

    def stop(self, slot: Slot) -> None:
        """An actor whose engine start hung: it goes (cluster/schedule/engine_starts.py)."""
        self.slots.remove(slot)
        self.io.kill(slot.handle)

    def unlend(self, slot: Slot) -> None:
        """Lent engines went away (`raysweep pool down --force`, the pool's client or a kept actor died): the model
        gets its own actors."""
        if slot in self.slots:
            self.slots.remove(slot)
            self.models[slot.model].max_actors = slot.actors
            self.lent_lost.append(slot.model)

    def sent(self, slot: Slot) -> None:
        """A shard went to `slot`: an actor of the sweep's is busy from now on (its tail clock)."""
        if not slot.lent:
            self.tail.sent(slot.number, slot.shape.num_gpus if getattr(slot.shape, "num_gpus", 0) else 1.0)

    def back(self, slot: Slot) -> None:
        if not slot.lent:
            self.tail.back(slot.number)

    def lose(self, slot: Slot, error: BaseException, job=None, unreachable: bool = False) -> None:
        """An actor died (`job`: the call that saw it): it is taken out, with the sweep's other actors on its node
        where the node was lost; their shards come back one by one as failed calls, and are retried."""
        if slot not in self.slots:
            return  # its death was already seen through another of its calls (or its node's loss)
        if slot.lent:  # the pool's client, or a kept actor, died: the model runs on actors of its own
            return self.unlend(slot)
        node = lost_node(error, slot.node, unreachable)  # a node lost takes every actor of the sweep there: said in one line
        gone = [s for s in self.slots if s is slot or node and not s.lent and s.node and s.node[0] == node[0]]
        held = self.inflight.held_by(gone) + [job] * (job is not None)
        if node is None or node[0] not in self.nodes_lost:  # a replacement that had started there: said already
            self.on_lost(lost_line([s.number for s in gone], node, first_line(error), held, self.max_attempts))
        self.nodes_lost |= {node[0]} if node else set()
        for gone_slot in gone:
            self.slots.remove(gone_slot)
            if gone_slot.model is not None and gone_slot.state in ENGINE_HELD:
                self.models[gone_slot.model].assigned -= 1
            self.tail.died(gone_slot.number)
            self.actor_deaths += 1
            self.io.kill(gone_slot.handle)
        if self.actor_deaths > self._most_slots * self.max_attempts:
            raise RuntimeError(f"{self.actor_deaths} actors died; the last: {first_line(error)}") from error

    def shut_down(self) -> None:
        slots, self.slots = [s for s in self.slots if not s.lent], []
        self._release(slots)

    def _release(self, slots: list[Slot]) -> None:
        """Those `keep` does not take: engines closed first, then the actors killed (`KeptActors`)."""
        slots = self.keep(slots) if self.keep is not None else slots
        self.io.close([s.handle for s in slots if s.state in UP], [s.handle for s in slots])
