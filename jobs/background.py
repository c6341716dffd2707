"""Work on a thread of its own while the caller goes on: Ray's start, while lm-eval builds its tasks or
requests (jobs/lifecycle.py, for `raysweep run` and `raysweep lm-eval`)."""

from __future__ import annotations

import threading


class Background:
    """`work()` on a thread of its own from now on; `result()` waits for it and raises what it raised.

    The thread outlives `work()`, parked until the process ends: the local Ray that ray.init starts is the
    thread's child, and Ray asks Linux to kill its processes when their parent thread ends (PR_SET_PDEATHSIG
    follows the thread, not the process): seen here, Ray's GCS gone a minute after the thread ended. A daemon:
    a process that ends meanwhile does not wait for it, and Ray's processes end with it."""

    def __init__(self, work, name: str):
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(work,), name=name, daemon=True).start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001  (raised again on the caller's thread, by result())
            self._error = e
        self._done.set()
        threading.Event().wait()  # parked: see the class's docstring

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error
