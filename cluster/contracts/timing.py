"""Wall-clock start-up figures shared by the driver and the actors (start-up is a first-class figure:
docs/design.md, Actors and engines). Times are UTC epoch seconds (`time.time()`), so figures taken in
different processes of one node compare; across nodes they carry the nodes' clock skew.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone


def process_started_at() -> float | None:
    """When this process was created (Linux /proc: its fork), or None where that cannot be read. An exec keeps
    it: a process that runs another program first and then execs into Python (a shell's last command, a pyenv
    shim) keeps the time it was created at (`command_started_at` says when the interpreter began). Actors'
    start-up figures count from here: the worker process Ray started."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        since_boot = start_ticks / os.sysconf("SC_CLK_TCK")
        try:  # the boot clock, not /proc/stat's btime: that is whole seconds, up to 1 s early
            return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
        except (AttributeError, OSError):
            with open("/proc/stat") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
            return boot + since_boot
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def command_started_at(entered_at: float, cpu_at_entry: float, children_before_entry: bool) -> float:
    """When the command's Python interpreter started: the figures a user's stopwatch is held against count from
    here ("12.3s after the command started", the manifest's `runs`, the report's timeline), so Python's start
    and the imports are inside them. `entered_at` is when the command's own code first ran (jobs/__init__.py),
    `cpu_at_entry` the process's CPU seconds then, `children_before_entry` whether it had waited for child
    processes by then.

    The process's creation (/proc) is the interpreter's start where nothing ran before the exec into Python. But
    `bash -c "sleep 10 && raysweep run ..."` forks `sleep`, waits for it, then execs into its last command:
    raysweep's process is the shell's, created 10 s before Python started (a pyenv shim does the same after its
    own `pyenv` commands). Python itself waits for no child before the command's code runs, so children waited
    for by then were another program's, before the exec: the process's creation is not Python's start, and
    Python's start-up counts as the CPU time it took (its waits on the disk or the scheduler cannot be told
    apart from the other program's), never from before the process was created. Where /proc cannot be read
    (macOS), the same."""
    created = process_started_at()
    if created is not None and not children_before_entry:
        return min(created, entered_at)
    estimate = entered_at - cpu_at_entry
    return estimate if created is None else max(created, estimate)


def utc(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc)


def since(start: float | None, end: float | None) -> float | None:
    """end - start in seconds, or None if either was not measured."""
    return None if start is None or end is None else max(0.0, end - start)


class RunClock:
    """One run of the sweep command: Ray start, planning, first and last result, each in seconds since the
    command started (the manifest's `runs` entries): `started_at`, by default this process's creation; the
    commands pass their interpreter's start (jobs.started_at)."""

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
