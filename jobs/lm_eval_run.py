"""The run of `raysweep lm-eval`'s models (`LmEvalRun`): the one SweepRun (jobs/lifecycle.py) that the models lm-eval
makes during one command share (one Ray and one set of engines per process), the output folders they keep, the
stop's line said once, and the teardown, once.

The command makes it and enters it (`with LmEvalRun() as run:`): lm-eval's models made inside find it as the
current run. A model made where no run is current (lm-eval's own `simple_evaluate(model="raysweep")` from Python)
makes its own, closed by a finalizer when the model goes (or at the interpreter's exit).
"""

from __future__ import annotations

import argparse
import contextvars
import os
import sys
import threading
import time

from cluster.contracts.errors import RaysweepError


class LmEvalError(RaysweepError, ValueError):
    """lm-eval's command line or raysweep's model_args cannot be used as given; the message names the option."""


_CURRENT: contextvars.ContextVar[LmEvalRun | None] = contextvars.ContextVar("raysweep_lm_eval_run", default=None)


def current_run() -> LmEvalRun | None:
    """The run entered by the command around lm-eval, if any."""
    return _CURRENT.get()


class LmEvalRun:
    def __init__(self, watch=None):
        """`watch`: the command's SilenceWatch (jobs/silence.py), told each stage lm-eval is in, if any."""
        self.watch = watch
        self.life = None  # the SweepRun, made with the first model
        self.outputs: list[str] = []  # the output= folders of the models made here: the stop's line names them
        self._stopped = threading.Lock()  # held once the stop's line is said: it is said once
        self._closed = threading.Lock()
        self._token = None

    def __enter__(self) -> LmEvalRun:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)
        self.close(quiet=exc[0] is not None)

    def stage(self, what: str | None) -> None:
        """What lm-eval is at now, for the command's watch (None: a sweep, which says its own progress)."""
        if self.watch is not None:
            self.watch.stage(what)

    def sweep_run(self, address: str | None):
        """The SweepRun of this run's models: made with the first, the same for the next ones (which must name
        its Ray)."""
        if self.life is not None:
            if (address or os.environ.get("RAY_ADDRESS") or "local") != self.life.address:
                raise LmEvalError(f"--model_args: address {address or 'local'}: this process runs its sweeps on "
                                  f"{self.life.address} already (one Ray per process)")
            return self.life
        from cluster.contracts.timing import RunClock
        from jobs import started_at
        from jobs.lifecycle import SweepRun

        args = argparse.Namespace(address=address, dashboard=False, verbose=False, new_run=False, max_attempts=3)
        self.life = SweepRun(args, RunClock(started_at()), log=lambda line: print(line, file=sys.stderr, flush=True),
                             keep_engines=True, address_option="address")
        return self.life

    def close(self, quiet: bool = False) -> None:
        """The SweepRun closed (its engines, Ray, engine host and temporary output), once. `quiet` (or after a stop's
        line, or where Ray never began): without the line saying what closes."""
        if self.life is None or not self._closed.acquire(blocking=False):
            return
        if not (quiet or self._stopped.locked()) and self.life.ray_begun:
            said("lm-eval is done: the engines and Ray close")
        self.life.close()

    def say_stopped(self, stop) -> None:
        """The command's line for its stop (a signal's Interrupted, or why else it stopped), said once, with
        os.write: from a signal handler or another thread."""
        if not self._stopped.acquire(blocking=False):
            return
        head = f"[raysweep] stopped by {stop}:" if isinstance(stop, BaseException) else f"[raysweep] stopped: {stop};"
        where = (f"what its sweeps committed is kept in {self.outputs[0]}: the same command resumes it" if self.outputs
                 else "pass output=DIR in --model_args to keep what its sweeps commit and resume it")
        os.write(2, f"{head} lm-eval wrote no results; {where}\n".encode())


def said(what: str) -> None:
    """One stage of the command, timed from its Python's start as the spec path's lines are (jobs/sweep.py)."""
    from jobs import started_at

    when = f" ({time.time() - started_at():.1f}s after the command started)"
    print(f"[raysweep] lm-eval: {what}{when}", file=sys.stderr, flush=True)
