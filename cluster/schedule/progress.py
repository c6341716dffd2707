"""Driver progress: samples done, samples/s and ETA.

On a terminal, a progress bar (tqdm); otherwise, as under `ray job logs` or in CI, a log line every
`every_s` seconds and one at the end. Other messages go through `log`, so they never tear the bar.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class LogProgress:
    """Progress as periodic log lines."""

    def __init__(self, total: int, log: Callable[[str], None], every_s: float = 2.0):
        self.total, self.log, self.every_s = total, log, every_s
        self.done, self.started, self.last = 0, time.perf_counter(), 0.0

    def grow(self, n: int) -> None:
        """More samples planned (planning runs while the first shards do)."""
        self.total += n

    def add(self, n: int, shard_id: str) -> None:
        self.done += n
        if time.perf_counter() - self.last >= self.every_s or self.done >= self.total:
            self._line(f"last: {shard_id}")

    def tick(self, doing: str) -> None:
        """Called while the sweep waits: a line when none came for `every_s`, saying what is going on."""
        if time.perf_counter() - self.last >= self.every_s:
            self._line(doing)

    def _line(self, tail: str) -> None:
        now = self.last = time.perf_counter()
        rate = self.done / max(now - self.started, 1e-9)
        eta = f"ETA {(self.total - self.done) / rate:.0f}s" if rate > 0 else "ETA ?"
        self.log(f"[raysweep] {self.done}/{self.total} samples ({100 * self.done / max(self.total, 1):.0f}%) "
                 f"{rate:.1f} samples/s, {eta} — {tail}")

    def close(self) -> None:
        pass


class BarProgress:
    """Progress as a tqdm bar on a terminal; log lines are printed above it."""

    def __init__(self, total: int, stream: TextIO):
        from tqdm import tqdm

        self.stream = stream
        self.done = 0
        sized = _columns(stream) > 0  # a terminal that reports no size (a bare pty) gets a fixed one; tqdm
        # would hide its bar there, as if it were below the screen
        self.bar = tqdm(total=total, unit=" samples", file=stream, dynamic_ncols=sized, ncols=None if sized else 100,
                        nrows=None if sized else 24, smoothing=0.1,
                        desc="[raysweep]", bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                                      "samples [{elapsed}<{remaining}, {rate_fmt}{postfix}]")

    def log(self, line: str) -> None:
        self.bar.write(line, file=self.stream)

    def grow(self, n: int) -> None:
        self.bar.total += n
        self.bar.refresh()

    def add(self, n: int, shard_id: str) -> None:
        self.done += n
        self.bar.set_postfix_str(f"last: {shard_id}", refresh=False)
        self.bar.update(n)

    def tick(self, doing: str) -> None:
        if not self.done:  # until the first result the bar says what is going on; then the last shard
            self.bar.set_postfix_str(doing, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _columns(stream: TextIO) -> int:
    import os

    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a real file descriptor
        return 0


def make_progress(total: int, log: Callable[[str], None], bar: bool | None = None, stream: TextIO | None = None):
    """A bar when `bar` is True, or when it is None and `stream` (stdout) is a terminal; else log lines."""
    stream = stream or sys.stdout
    if bar is None:
        bar = stream.isatty()
    return BarProgress(total, stream) if bar else LogProgress(total, log)
