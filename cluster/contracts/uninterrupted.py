"""A stretch of the driver's work that a stop signal does not cut: the end of a run, where the run's record, its
summary and its telemetry are written from what was committed. The signal's handler (jobs/interrupts.py) asks
`holding()`; where a stretch is under way it says its line and leaves the stop here (`hold`), and the stop is
raised as the stretch ends. A second signal still stops the process at once."""

from __future__ import annotations

import threading
from contextlib import contextmanager

_STATE = {"depth": 0, "held": None}  # the main thread's stretches open, and the stop that came in one


def holding() -> bool:
    """Whether the main thread is in an uninterrupted stretch (the signal's handler runs in the main thread)."""
    return _STATE["depth"] > 0


def hold(stop: BaseException) -> None:
    """A stop that came during a stretch, raised as the outermost one ends."""
    if _STATE["held"] is None:
        _STATE["held"] = stop


@contextmanager
def uninterrupted():
    """The block runs to its end through a stop signal, which is raised after it (in the main thread; elsewhere
    signals do not arrive, and the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1
        if _STATE["depth"] == 0 and _STATE["held"] is not None:
            stop, _STATE["held"] = _STATE["held"], None
            raise stop
