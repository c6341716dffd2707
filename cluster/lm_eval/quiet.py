"""lm-eval kept out of a sweep's terminal while raysweep calls it (cluster/lm_eval/run.py): its progress
bars, log lines, prints and the stderr of what it runs. A sweep's stdout is raysweep's lines and its table."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading


_TERMINAL: list[int] = []  # the process's own stderr, kept while `quiet()` points fd 2 elsewhere (outermost first)


def terminal_stderr() -> int:
    """The file descriptor of the terminal's stderr, also while lm-eval is kept quiet: a stop signal's one line is
    written there (jobs/sweep.py), not into /dev/null with lm-eval's."""
    return _TERMINAL[0] if _TERMINAL else 2


@contextlib.contextmanager
def quiet():
    """lm-eval's progress bars, INFO and WARNING lines, what it prints (`bootstrapping for stddev: perplexity`,
    which landed among the run's lines by its summary table) and its `git describe` (whose "fatal: not a git
    repository" goes to the process's stderr) kept out of the sweep's terminal; its errors still raise. Its
    prints go to its logger at INFO (`_PrintsLogged`), held back here with its own INFO lines."""
    logger = logging.getLogger("lm_eval")
    level, before = logger.level, os.environ.get("TQDM_DISABLE")
    logger.setLevel(logging.ERROR)
    os.environ["TQDM_DISABLE"] = "1"
    sys.stderr.flush()
    saved = os.dup(2)
    _TERMINAL.append(saved)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    stdout, sys.stdout = sys.stdout, _PrintsLogged(sys.stdout, logger)
    try:
        yield
    finally:
        sys.stdout = stdout
        sys.stderr.flush()
        os.dup2(saved, 2)
        _TERMINAL.remove(saved)
        os.close(saved)
        logger.setLevel(level)
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


class _PrintsLogged(io.TextIOBase):
    """sys.stdout while `quiet()` runs: what the thread that entered it prints (lm-eval's calls) goes, line by
    line, to lm-eval's logger; what other threads print (raysweep's Ray start, timed lines) goes on to stdout."""

    def __init__(self, stdout, logger: logging.Logger):
        super().__init__()
        self._stdout, self._logger, self._thread, self._line = stdout, logger, threading.get_ident(), ""

    def write(self, text: str) -> int:
        if threading.get_ident() != self._thread:
            return self._stdout.write(text)
        *lines, self._line = (self._line + text).split("\n")
        for line in lines:
            self._logger.info("%s", line)
        return len(text)

    def flush(self) -> None:
        self._stdout.flush()

    def fileno(self) -> int:
        return self._stdout.fileno()

    @property
    def encoding(self) -> str:
        return self._stdout.encoding
