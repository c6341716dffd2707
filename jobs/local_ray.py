"""A local Ray that a raysweep command started for itself: its reaper, and its stop.

`head_lost()`: which of its head processes (GCS, raylet) has ended, and how (jobs/head_watch.py watches them).
`reaper()`, before ray.init: a reaper process (jobs/ray_reaper.py) that ends what this Ray leaves running if the
command is killed before its run (jobs/lifecycle.py) stops this Ray and releases it. `stopping()`: whether this
process is stopping its Ray now, so that its GCS ending then is not taken for a lost one (jobs/interrupts.py gives
up a cleanup on a lost GCS).

`shutdown()`: `ray.shutdown`, with Ray's autoscaler monitor killed first where this process started the node.
Ray (2.60) stops its GCS before the monitor, whose SIGTERM handler then tries to report to the gone GCS until
Ray kills it a second later: 1.0 s of a local command's 1.4 s shutdown, every run (measured on a 2-core machine).

Ray's idle workers started ahead (`prestart_worker_first_driver`, one per CPU when the driver connects) are
left as Ray has them: without them the quickstart on a 2-core machine took 11.6-12.3 s against 12.7-14.3 s,
but on a 16-core H200 machine a 1,312-prompt sweep took 42.2, 45.6 and 39.9 s against 35.0, 42.6 and 36.6 s
with them, in three rounds of one lease with the order swapped in the last (bench/records/h200-run-finish.md).
"""

from __future__ import annotations

import os
import sys
import threading

HEAD = ("gcs_server", "raylet")  # Ray's process kinds (ray_constants.PROCESS_TYPE_*) whose end ends the node
_STOPPING = threading.Event()  # set while shutdown() stops a Ray whose head was running when it began


def reaper():
    """A reaper (jobs/ray_reaper.py Reaper) for the local Ray this process is about to start, or None off Linux (it
    reads /proc). Its owner releases it once this Ray is stopped."""
    from jobs.ray_reaper import Reaper

    return Reaper() if sys.platform.startswith("linux") else None


def shutdown() -> None:
    """ray.shutdown, without the monitor's second (a no-op where Ray is not up, as ray.shutdown is)."""
    import subprocess

    import ray
    from ray._private import worker  # Ray is pinned (pyproject.toml); tests/test_local_ray.py checks this

    node = worker._global_node
    if head_lost() is None:  # a head lost before this stop began is still a lost one
        _STOPPING.set()
    try:
        for info in (getattr(node, "all_processes", None) or {}).get("monitor", []):
            try:
                info.process.kill()  # SIGKILL: what Ray sends it a second later anyway
                info.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass  # Ray's own stop deals with it, as it would have
        ray.shutdown()
    finally:
        _STOPPING.clear()


def stopping() -> bool:
    return _STOPPING.is_set()


def head_lost(head: list[tuple[str, int]] | None = None) -> str | None:
    """Which head process of the local Ray this process started has ended, and how ("its gcs_server, pid 12, was
    killed by signal 9"); None while they run, or where this process started none."""
    for kind, pid in head_processes() if head is None else head:
        ended = _ended(pid)
        if ended:
            return f"its {kind}, pid {pid}, {ended}"
    return None


def head_processes() -> list[tuple[str, int]]:
    """(kind, pid) of the head processes of the Ray this process started; none where it only connected."""
    from ray._private import worker  # Ray is pinned (pyproject.toml); tests/test_signals.py kills a real head

    node = worker._global_node
    processes = getattr(node, "all_processes", None) or {}
    return [(kind, info.process.pid) for kind in HEAD for info in processes.get(kind, [])]


def _ended(pid: int) -> str | None:
    """How a child process ended ("was killed by signal 9", "exited with 1"), or None while it runs (or where it is
    not this process's child: nothing to tell)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return f"exited with {info.si_status}"
    return f"was killed by signal {info.si_status}"
