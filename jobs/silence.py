"""No silent wait: while a command waits on work it does not see into (lm-eval indexing its 14,000 task files,
loading datasets, building requests), a line every SAY_AFTER_S seconds of silence says what it waits for and for
how long. The command names each stage as it enters it (`stage`); a stage of None (a sweep, which prints its own
progress) is not watched.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

SAY_AFTER_S = 10.0


class SilenceWatch:
    def __init__(self, say: Callable[[str], None], after_s: float | None = None):
        self.say, self.after_s = say, SAY_AFTER_S if after_s is None else after_s
        self._what: str | None = None
        self._since = self._heard = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raysweep-silence-watch", daemon=True)

    def stage(self, what: str | None) -> None:
        """The command now waits on `what` (None: on nothing this watch should speak for)."""
        with self._lock:
            self._what, self._since = what, time.monotonic()
            self._heard = self._since

    def __enter__(self) -> SilenceWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=1)

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.after_s / 4)):
            with self._lock:
                now = time.monotonic()
                if self._what is None or now - self._heard < self.after_s:
                    continue
                self._heard = now
                line = (f"[raysweep] still waiting: {self._what} ({now - self._since:.0f}s so far; load "
                        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s))")
            self.say(line)


def watched(say: Callable[[str], None], what: str) -> SilenceWatch:
    """A watch of one stage, `what`, for a `with` block."""
    watch = SilenceWatch(say)
    watch.stage(what)
    return watch
