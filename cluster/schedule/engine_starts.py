"""How long an engine may take to start, which starts are past it, and an actor that cannot start at all.

An engine start that raises fails at once, with the engine's own error. One that never answers (seen: a
tensor-parallel vLLM engine whose workers died in a CUDA error left its engine core waiting for them) would
hold its actor and its GPUs for ever; past `start_timeout_s()` the scheduler kills the actor and treats the
model there as one whose start raised. The bound covers a cold start of a large model (weights read from
disk, torch.compile, CUDA graph capture): about 2 minutes for a small model's first start with an empty
compile cache on an H100. `RAYSWEEP_ENGINE_START_TIMEOUT_S` changes it.
"""

from __future__ import annotations

import os
import time

from cluster.contracts.errors import RaysweepError
from cluster.contracts.shard import ActorCall

ENV = "RAYSWEEP_ENGINE_START_TIMEOUT_S"
DEFAULT_S = 900.0


class ActorStartError(RaysweepError, RuntimeError):
    """An actor could not start at all (its imports failed); the message carries the error."""


class StartTimeoutSetting(RaysweepError, ValueError):
    """RAYSWEEP_ENGINE_START_TIMEOUT_S is not a positive number of seconds."""


def start_timeout_s() -> float:
    """The bound, from the environment (read on each call: tests and users set it per run)."""
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_S
    except ValueError:
        raise StartTimeoutSetting(f"{ENV}={raw!r}: must be a number of seconds") from None
    if value <= 0:
        raise StartTimeoutSetting(f"{ENV}={raw!r}: must be more than 0 seconds")
    return value


def take_overdue(inflight: dict, timeout_s: float, now: float | None = None, answered=None) -> list:
    """The slots of the engine starts in `inflight` ({ref: (kind, job, slot)}) asked for more than `timeout_s`
    ago (a slot's `start_at`, time.monotonic()), their calls taken out of `inflight`. `answered(ref)`: whether a
    call's answer is in already (not collected yet, the loop takes one a turn): such a start is not overdue."""
    now = time.monotonic() if now is None else now
    late = [ref for ref, (kind, _, slot) in inflight.items()
            if kind == ActorCall.START and slot.start_at is not None and now - slot.start_at > timeout_s
            and not (answered is not None and answered(ref))]
    return [inflight.pop(ref)[2] for ref in late]


def timed_out_line(timeout_s: float) -> str:
    return f"engine did not start within {timeout_s:g} s ({ENV}); its actor was stopped"
