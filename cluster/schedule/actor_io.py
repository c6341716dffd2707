"""The scheduler's I/O with Ray (cluster/schedule/scheduler.py and fleet.py decide; this does): each call they
decided on (cluster/schedule/work.py Call) made on its actor's handle, the wait for the first call to answer,
each answer read as a typed outcome, actors killed, engines closed. A stand-in I/O with stand-in handles
(tests/scheduler_fakes.py) runs the scheduler with no Ray at all.

Outcomes, told apart by `isinstance` on Ray's exceptions:
- `Answered(value)`: the call returned;
- `ActorLost(error, init_failed, unreachable)`: the actor's process died, or could not be reached
  (RayActorError; `unreachable`: an ActorUnavailableError); with `init_failed`, its constructor raised (its
  imports: every actor's would);
- `CallRaised(cause, error, died)`: the call raised in a live actor (RayTaskError); `cause` is the exception the
  actor raised (an engine's error); `died`: the engine that ran it died and the engines lent to the sweep stand
  (a pool replica's death, cluster/contracts/pool_protocol.py ReplicaDied): retried as on an actor's death;
- `EnginesGone(error)`: the engines lent to the sweep behind that handle went away (the pool taken down:
  PoolGone): the call's shard goes back to its queue, and the model to actors of the sweep's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.contracts.shard import ACTOR_METHODS


@dataclass(frozen=True)
class Answered:
    value: Any


@dataclass(frozen=True)
class ActorLost:
    error: BaseException
    init_failed: bool = False
    unreachable: bool = False  # Ray cannot reach its process but counts it alive (ActorUnavailableError)


@dataclass(frozen=True)
class CallRaised:
    cause: BaseException | None
    error: BaseException
    died: bool = False  # the engine that ran the call died (a pool replica's): retried, never bisected

    @property
    def raised(self) -> BaseException:
        """What the actor raised, where Ray kept it, else Ray's own error."""
        return self.cause if self.cause is not None else self.error


@dataclass(frozen=True)
class EnginesGone:
    error: BaseException


Outcome = Answered | ActorLost | CallRaised | EnginesGone


class RayIO:
    """The scheduler's I/O on a connected Ray."""

    def send(self, call) -> Any:
        """Make `call` (cluster/schedule/work.py Call) on its slot's handle: the ref of its answer."""
        return getattr(call.slot.handle, ACTOR_METHODS[call.kind]).remote(*call.args)

    def wait(self, refs: list, timeout_s: float) -> list:
        """The first of `refs` to answer within `timeout_s` (a list of one), or none."""
        import ray

        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        return ready

    def answered(self, ref) -> bool:
        """Whether `ref`'s answer is in already (not read yet)."""
        import ray

        return bool(ray.wait([ref], timeout=0)[0])

    def outcome(self, ref) -> Outcome:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        from cluster.contracts.pool_protocol import PoolGone, ReplicaDied

        try:
            return Answered(ray.get(ref))
        except RayActorError as e:
            return ActorLost(e, bool(e.actor_init_failed), isinstance(e, ActorUnavailableError))
        except RayTaskError as e:
            if isinstance(e.cause, PoolGone):
                return EnginesGone(e.cause)
            return CallRaised(e.cause, e, died=isinstance(e.cause, ReplicaDied))

    def kill(self, handle) -> None:
        import ray

        ray.kill(handle)

    def close(self, running: list, handles: list, timeout_s: float = 120) -> None:
        """Close the engines of `running` first (a killed actor would orphan vLLM's engine-core process and its GPU
        memory), then kill every actor of `handles`; an actor already dead or stuck is just killed."""
        import ray

        if running:
            ray.wait([handle.close.remote() for handle in running], num_returns=len(running), timeout=timeout_s)
        for handle in handles:
            ray.kill(handle)
