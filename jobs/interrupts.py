"""Ctrl-C and SIGTERM (what `ray job stop` and most schedulers send) end a sweep in one line.

The first signal raises `Interrupted` in the driver's main thread, wherever it is (checks, Ray's start, the
scheduler's loop, scoring): the run's own cleanup then runs as on any error (engines closed, the telemetry
and summary of what was committed written, the output's lock released, a local Ray this run started shut
down), and the edge prints what was committed and how to resume. A second signal stops the process at once.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_OURS: list = []  # the handler interruptible() installed, while it is in force


class Interrupted(BaseException):
    """A signal asked the run to stop. A BaseException, as KeyboardInterrupt is: inner code's
    `except Exception` never swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def interruptible():
    """The first SIGINT or SIGTERM raises Interrupted here; the second exits at once (128 + signal)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def second(signum, frame):
        os.write(2, f"\n[raysweep] {signal.Signals(signum).name} again: stopped at once\n".encode())
        os._exit(128 + signum)

    def first(signum, frame):
        for s in SIGNALS:
            signal.signal(s, second)
        raise Interrupted(signum)

    before = {s: signal.signal(s, first) for s in SIGNALS}
    _OURS.append(first)
    try:
        yield
    finally:
        _OURS.remove(first)
        for s, handler in before.items():
            signal.signal(s, handler)


def reclaim() -> None:
    """Take SIGTERM and SIGINT back after `ray.init`, which installs its own handlers over ours: one that
    exits with the signal's number and no word, and a C-level one that prints "*** SIGTERM received ***"
    with a stack dump."""
    if threading.current_thread() is not threading.main_thread() or not _OURS:
        return
    for s in SIGNALS:
        signal.signal(s, _OURS[-1])


def stopped_line(stop: Interrupted, sink, output: str | None) -> str:
    """What the edge prints: the signal, what the output holds now, how to resume."""
    if sink is None:
        return f"[raysweep] stopped by {stop}: before the output was opened; nothing was written"
    shards = sink.manifest.get("shards", {})
    done = len(sink.committed())
    return (f"[raysweep] stopped by {stop}: {done} of {len(shards)} shard(s) committed in {output}; "
            "the same command resumes the rest")
