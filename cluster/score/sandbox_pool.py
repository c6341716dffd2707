"""The pool that runs many programs concurrently on this node, off the caller's thread, one thread per
running sandbox: a program whose sandbox fails to start (SandboxError, or an OSError such as EAGAIN from
fork) is tried again, then recorded as an `error` with `started` False; a batch fails only when none of it
started. Closing the pool kills the programs still running (a stopped run ends in seconds, not when their
wall clocks run out): what they were batches of is cancelled.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

from cluster.score.sandbox_launch import Running
from cluster.score.sandbox_outcome import ExecStatus, Outcome
from cluster.score.sandbox_probe import check_available, run_program
from cluster.score.sandbox_types import SandboxError, SandboxLimits

RETRY_PAUSES_S = (0.2, 1.0)  # before each new try of a program whose sandbox failed to start (EAGAIN passes)


class SandboxPool:
    """Runs many programs concurrently on this node, off the caller's thread: one thread per running sandbox."""

    def __init__(self, workers: int | None = None):
        workers = (os.cpu_count() or 1) if workers is None else workers
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")
        self._running = Running()  # killed by close()

    def submit(self, programs: list[str], limits: SandboxLimits, unsafe_fallback: bool = False,
               as_main: bool = False) -> concurrent.futures.Future:
        """A future of the programs' Outcomes in order. A program whose sandbox fails to start is tried again,
        then its Outcome is an `error` with `started` False; the future fails (SandboxError) only where no
        program started, or on a fault of this code, and then cancels the rest."""
        check_available(unsafe_fallback)  # no sandbox here: SandboxError now, not once per program
        result: concurrent.futures.Future = concurrent.futures.Future()
        parts = [self._threads.submit(_tries, p, limits, unsafe_fallback, as_main, self._running) for p in programs]
        left, lock = [len(parts)], threading.Lock()

        def part_done(part: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if result.done():  # failed by another part, or cancelled by the caller
                return
            if self._running.killed:  # the pool closed under it: its programs were killed, not ended
                result.cancel()
                return
            if not part.cancelled() and part.exception() is not None:
                _settle(result, exception=part.exception())
            elif last:
                if any(p.cancelled() for p in parts):  # the pool closed under it (a stop): nobody waits for it
                    result.cancel()
                    return
                outcomes = [p.result() for p in parts]
                if any(o.started for o in outcomes):
                    _settle(result, value=outcomes)
                else:  # the sandbox is broken, not one program's start unlucky
                    _settle(result, exception=SandboxError(f"no program of {len(parts)} started: {outcomes[0].error}"))

        def result_done(_: concurrent.futures.Future) -> None:
            for part in parts:  # failed or cancelled: the programs not started yet are dropped
                part.cancel()

        result.add_done_callback(result_done)
        if not parts:
            result.set_result([])
        for part in parts:
            part.add_done_callback(part_done)
        return result

    def close(self) -> None:
        """The programs not started are dropped, those running killed; returns once their threads are done."""
        self._running.kill()
        self._threads.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tries(source: str, limits: SandboxLimits, unsafe_fallback: bool, as_main: bool = False,
           running: Running | None = None) -> Outcome:
    """run_program, tried again after each of RETRY_PAUSES_S where its sandbox failed to start; after the last
    try an `error` Outcome saying why, with `started` False. Not tried again once `running` was killed."""
    start = time.perf_counter()
    for pause in (*RETRY_PAUSES_S, None):
        try:
            return run_program(source, limits, unsafe_fallback, as_main, running)
        except (SandboxError, OSError) as e:
            if pause is None or (running is not None and running.killed):
                why = str(e) if isinstance(e, SandboxError) else f"{type(e).__name__}: {e}"
                return Outcome(ExecStatus.ERROR,
                               f"the sandbox failed on each of {len(RETRY_PAUSES_S) + 1} tries: {why}", None,
                               time.perf_counter() - start, started=False)
            time.sleep(pause)


def _settle(result: concurrent.futures.Future, value=None, exception=None) -> None:
    try:
        result.set_exception(exception) if exception is not None else result.set_result(value)
    except concurrent.futures.InvalidStateError:  # cancelled by the caller, or failed by another part
        pass
