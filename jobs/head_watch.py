"""A command's own local Ray watched while the command uses it (`head_watched`): where its head ends (the GCS or
the raylet: killed, crashed, taken by the OOM killer), the command says one line and exits 1 in about a second.
Left to Ray, the sweep goes on (its actors answer without the GCS) until a call that needs the GCS waits out Ray's
60 s for it (`gcs_rpc_server_reconnect_timeout_s`), and Ray ends the process with a C++ "Failed to connect to GCS"
line. What was committed is in the manifest (each commit is whole on disk, as for a killed driver): the same
command resumes the rest on a new local Ray. The Ray processes still running are the reaper's (jobs/ray_reaper.py).

The head's processes are this process's children: each is watched by its exit, without reaping it (waitid with
WNOWAIT), so Ray's own stop still finds it to wait for. A head that ends with a stop signal to the command (a
SIGTERM or SIGHUP to its whole process group reaches Ray's processes too) is that stop's (jobs/interrupts.py):
the loss is said only where no signal came by the next look.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable

HEAD_LOOK_S = 0.5  # how often the head's processes are looked at


@contextmanager
def head_watched(say: Callable[[str], None]):
    """While in force, where a head process of the local Ray this process started has ended: `say(why)` (from
    another thread; `why` names the process and how it ended), then exit 1 at once. Nothing is watched where this
    process started no Ray (it joined a cluster). Leaving it stops the watch before anything else happens (the
    command's own stop of its Ray ends the same processes)."""
    from jobs.local_ray import head_processes

    head = head_processes()
    if not head:
        yield
        return
    stop, lock = threading.Event(), threading.Lock()

    def watch() -> None:
        from jobs.interrupts import signalled
        from jobs.local_ray import head_lost

        seen = None
        while not stop.wait(HEAD_LOOK_S):
            with lock:  # held while looking: the watch is never mid-look when the command stops its Ray
                lost = None if stop.is_set() or signalled() else head_lost(head)
                if lost and seen:  # a look later, still no signal: not a head sent the command's own stop
                    try:
                        say(f"this run's local Ray lost its head ({lost})")
                    finally:
                        os._exit(1)
                seen = lost

    threading.Thread(target=watch, name="raysweep-head-watch", daemon=True).start()
    try:
        yield
    finally:
        with lock:
            stop.set()
