"""Ctrl-C, SIGTERM (what `ray job stop` and most schedulers send) and SIGHUP (a closed terminal) end a sweep in
one line.

The first signal raises `Interrupted` in the driver's main thread, wherever it is (checks, Ray's start, the
scheduler's loop, scoring): the run's own cleanup then runs as on any error (engines closed, the telemetry
and summary of what was committed written, the output's lock released, a local Ray this run started shut
down). Where it comes while the run's end is being written (cluster/contracts/uninterrupted.py), it is raised once
that is done. The line saying what was committed and how to resume is said at the signal, before that cleanup (`say`).
A second signal stops the process at once. Where the signal also ended the cluster's GCS (a SIGTERM to the whole
process group reaches the local Ray this run started), every Ray call of that cleanup would wait out Ray's 60 s
GCS timeout and then abort the process with a C++ message: once the GCS stops answering, the run gives up its
cleanup and exits. What was committed is in the manifest already; the output's lock is the OS's (flock).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable

from cluster.contracts.shard import ShardState
from cluster.contracts.uninterrupted import hold, holding
from cluster.lm_eval.quiet import terminal_stderr  # a stop's line reaches the terminal while lm-eval is quiet
from jobs import in_forked_child

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed
_OURS: list = []  # the handler interruptible() installed, while it is in force
_SIGNALLED = threading.Event()  # set the moment one of SIGNALS reaches a process under interruptible()


class Interrupted(BaseException):
    """A signal asked the run to stop. A BaseException, as KeyboardInterrupt is: inner code's
    `except Exception` never swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


FINALIZER_WAIT_S = 0.05  # a signal that came inside a finalizer is taken again this much later, out of it
GCS_PROBE_S = 0.5  # how often, after a signal, the run checks that the cluster's GCS still answers
GCS_LOST_AFTER = 2  # refused connections in a row that say the GCS is gone (not a busy moment)


@contextmanager
def interruptible(say: Callable[[Interrupted], None] | None = None):
    """The first SIGINT, SIGTERM or SIGHUP raises Interrupted here; the second, here or after (the process's
    exit), exits at once (128 + signal).
    `say(stop)`: the run's line, said at the first signal, before the cleanup (`ray job stop` sends SIGKILL 3 s
    after its SIGTERM, which a cleanup of closing engines may outlast); and where after it the connected
    cluster's GCS stops answering, the process then exits (1) without its cleanup. `say` is called from the
    signal handler or another thread: it writes with os.write, and says its line once."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    taken: list[int] = []  # the signal that stopped the run, once one did

    def second(signum, frame):
        in_forked_child(signum)
        os.write(terminal_stderr(), f"\n[raysweep] {signal.Signals(signum).name} again: stopped at once\n".encode())
        os._exit(128 + signum)

    def first(signum, frame):
        in_forked_child(signum)
        if _in_finalizer(frame):  # raised there, Python would print it as "Exception ignored" and go on
            main = threading.main_thread().ident  # sent again as a signal: a blocking call of the main thread ends
            threading.Timer(FINALIZER_WAIT_S, signal.pthread_kill, args=(main, signum)).start()
            return
        taken.append(signum)
        _SIGNALLED.set()
        for s in SIGNALS:
            signal.signal(s, second)
        stop = Interrupted(signum)
        if say is not None:
            say(stop)
        if holding():  # the run's end is being written: the stop is raised once it is
            hold(stop)
            return
        raise stop

    first.raysweep_stop = second.raysweep_stop = True  # not a forked child's (jobs/__init__.py)
    before = {s: signal.signal(s, first) for s in SIGNALS}
    _OURS.append(first)
    watch = _SignalWatch(say) if say is not None else None
    try:
        yield
    finally:
        if watch is not None:
            watch.close()
        _OURS.remove(first)
        for s, handler in before.items():  # a stopped run's process is ending: another signal ends it at once
            signal.signal(s, second if taken else handler)


def _in_finalizer(frame) -> bool:
    """Whether the main thread is inside a finalizer (a weakref.finalize callback, a __del__) that the garbage
    collector runs wherever it happens to be: an exception raised there never reaches the run (seen: the signal
    landed in a staging folder's rmtree, and the run printed a traceback and went on)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__" and code.co_filename == weakref.__file__):
            return True
        if code.co_name == "cb" and code.co_filename == "<frozen importlib._bootstrap>":  # a module lock's weakref
            return True  # callback (seen once in about 30 Ctrl-Cs during the imports: the run went on, exit 0)
        frame = frame.f_back
    return False


def signalled() -> bool:
    """Whether a stop signal has reached this process (seen by the wakeup pipe even while the main thread is in a
    C call, before its handler runs): what ends with it (a local Ray's head, sent the same signal) is that stop."""
    return _SIGNALLED.is_set()


def interrupted_in(error: BaseException) -> Interrupted | None:
    """The Interrupted an exception was raised from (its cause or context, at any depth), if any: the handler's
    Interrupted raised inside a C call that checks signals but mishandles what it raises comes back as
    "SystemError: <cyfunction CoreWorker.wait> returned a result with an exception set" (Ray's ray.wait)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Interrupted):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _SignalWatch:
    """Signals seen the moment they arrive, not when the main thread next runs Python (it may be inside a
    C call, as ray.init's 30 s wait for a GCS that died): Python's C-level handler writes each signal's
    number to a wakeup pipe, read by a thread that then watches the GCS (`_abandon_when_gcs_gone`)."""

    def __init__(self, say: Callable[[Interrupted], None]):
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.write_fd = write_fd
        self.before = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._wait, args=(say,), daemon=True, name="raysweep-signal-watch").start()

    def _wait(self, say) -> None:
        for number in iter(lambda: os.read(self.read_fd, 1), b""):
            if number[0] in {int(s) for s in SIGNALS}:
                _SIGNALLED.set()
                _abandon_when_gcs_gone(Interrupted(number[0]), say)
                return

    def close(self) -> None:
        signal.set_wakeup_fd(self.before)
        os.close(self.write_fd)  # the thread's read ends


def _abandon_when_gcs_gone(stop: Interrupted, say: Callable[[Interrupted], None]) -> None:
    """After a signal, while the process cleans up: where the GCS is gone (its port refuses GCS_LOST_AFTER
    times in a row, or the local Ray's gcs_server, this process's child, has exited), the cleanup cannot finish
    (each Ray call waits 60 s for it, ray.init 30 s): say the line, exit 1. Not while the cleanup itself stops the
    local Ray (jobs/local_ray.py): the rest of it (the engine host, what is removed at exit) still runs."""
    from jobs import local_ray

    refused = 0
    while True:
        refused = 0 if local_ray.stopping() else refused + 1 if _gcs_gone() else 0  # its own stop: not a loss
        if refused >= GCS_LOST_AFTER:
            try:
                say(stop)  # said already at the signal, unless the main thread was inside a C call
            finally:
                os._exit(1)
        time.sleep(GCS_PROBE_S)


def _gcs_gone() -> bool:
    """Whether the cluster's GCS is gone; False where it cannot be told (a slow answer is not a lost GCS)."""
    import ray

    try:
        address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    except Exception:  # Ray half connected or half shut down: only the local children can tell
        address = None
    if address is None:  # not connected yet: a local Ray starting is this process's children
        return _local_gcs_exited()
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_PROBE_S).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _local_gcs_exited() -> bool:
    """A gcs_server among this process's children that has exited (a zombie: nobody waited for it yet)."""
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            children = f.read().split()
    except OSError:  # no /proc (macOS): cannot tell
        return False
    for pid in children:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read()
        except OSError:
            continue
        name, state = fields[fields.index("(") + 1:fields.rindex(")")], fields[fields.rindex(")") + 2:][:1]
        if name == "gcs_server" and state == "Z":
            return True
    return False


def reclaim() -> None:
    """Take SIGTERM and SIGINT back after `ray.init`, which installs its own handlers over ours: one that
    exits with the signal's number and no word, and a C-level one that prints "*** SIGTERM received ***"
    with a stack dump."""
    if threading.current_thread() is not threading.main_thread() or not _OURS:
        return
    for s in SIGNALS:
        signal.signal(s, _OURS[-1])


def stopped_line(stop: Interrupted | str, sink, output: str | None, verifying: bool = False,
                 kept: bool = True, complete: bool = False) -> str:
    """What the edge prints: the signal (or why else the run stopped), what the output holds now, how to resume.
    `verifying`: `raysweep verify`'s own sweep, which starts afresh every time, into a temporary folder removed as
    the command ends, or into its --keep folder (`kept`). `complete`: every shard of the sweep is planned and
    committed (the run's end, its summary and telemetry, is written all the same)."""
    head = f"[raysweep] stopped by {stop}:" if isinstance(stop, Interrupted) else f"[raysweep] stopped: {stop};"
    if verifying:
        where = f"; its sweep's rows so far stay in {output} (run it again with another --keep folder)" \
            if kept and sink is not None else "; run the command again"
        return f"{head} the output it verifies is unchanged{where}"
    if sink is None:
        return f"{head} before the output was opened; nothing was written"
    shards = dict(sink.manifest.get("shards", {}))  # a copy, made at once: commits may go on on another thread
    done = sum(entry.get("state") == ShardState.COMMITTED for entry in shards.values())
    if not shards:  # Ray starting, or the first plan not made yet: the output may not even be kept
        return f"{head} before any shard was planned; nothing was committed, and the same command starts the sweep"
    if complete:
        return f"{head} all {done} shard(s) of the sweep committed in {output}; its summary is written as it stops"
    return f"{head} {done} of {len(shards)} shard(s) committed in {output}; the same command resumes the rest"
