"""Wall-clock start-up figures shared by the driver and the actors (start-up is a first-class figure:
docs/design.md, Actors and engines). Times are UTC epoch seconds (`time.time()`), so figures taken in
different processes of one node compare; across nodes they carry the nodes' clock skew.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone


def process_started_at() -> float | None:
    """When this process was created (Linux /proc), or None where that cannot be read. The driver's
    figures count from here, so Python start and imports are inside them, as a user's stopwatch would be."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def utc(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc)


def since(start: float | None, end: float | None) -> float | None:
    """end - start in seconds, or None if either was not measured."""
    return None if start is None or end is None else max(0.0, end - start)


class RunClock:
    """One run of the sweep command: Ray start, planning, first and last result, each in seconds since the
    driver process started (the manifest's `runs` entries)."""

    def __init__(self, started_at: float | None = None):
        self.started_at = started_at or process_started_at() or time.time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str, once: bool = False) -> None:
        if not (once and name in self.marks):
            self.marks[name] = time.time()

    def record(self) -> dict:
        figures = {f"{name}_s": since(self.started_at, self.marks.get(name))
                   for name in ("ray_start", "planning", "first_result", "last_result")}
        return {"started_at": utc(self.started_at).isoformat(), **figures,
                "wall_s": since(self.started_at, time.time())}
