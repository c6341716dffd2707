"""Actors whose engines outlive one sweep, for a process that runs several sweeps of the same model in a row:
`raysweep lm-eval --model raysweep` runs one sweep per request type lm-eval asks for (loglikelihood, then
generate_until, ...), and each would otherwise start its engines again (tens of seconds each on a GPU).

The first sweep starts its actors as any sweep does; when it no longer needs one whose engine runs, the
scheduler hands it here instead of closing it (SweepScheduler's `keep`). A later sweep of a model with the
same path and engine arguments sends its shards to those actors as it would to the engine pool (a "pooled"
slot: no actor of its own starts for the model); should one of them have died, the model gets actors of its
own again. `close` ends them, as a sweep ends the actors it does not keep (`close_actors`).
"""

from __future__ import annotations

import ray

from cluster.contracts.shard import ActorState
from cluster.contracts.spec import ModelSpec


def close_actors(running: list, handles: list, timeout_s: float = 120) -> None:
    """Close the engines of `running` first (a killed actor would orphan vLLM's engine-core process and its GPU
    memory), then kill every actor of `handles`; an actor already dead or stuck is just killed."""
    if running:
        ray.wait([handle.close.remote() for handle in running], num_returns=len(running), timeout=timeout_s)
    for handle in handles:
        ray.kill(handle)


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
        close_actors(actors, actors)
