"""Driver progress: samples done, samples/s and ETA; between results, what the sweep is doing; and the
sweep's live metrics for Prometheus and the Ray dashboard.

On a terminal, a progress bar (tqdm); otherwise, as under `ray job logs` or in CI, a log line every
`every_s` seconds and one at the end. Other messages go through `log`, so they never tear the bar.
While no result comes, `Ticks` tells the progress what the actors are doing (their states, counted by name)
and how many shards are in flight, at most once every TICK_EVERY_S.

`SweepMetrics`: the sweep's live metrics, through `ray.util.metrics`: Ray exports them on every node's Prometheus
endpoint (`ray_` prefixed; counters end in `_total`) and the Ray dashboard's Metrics view graphs them.

All are recorded by the driver as shard results arrive, so they survive the actors that produced them:
samples done, output tokens (and the last shard's output tok/s) per actor, shards in flight / done /
failed, and each actor's latest NVML GPU memory reading. Tags: sweep, model, task, actor. A figure that
was not measured (no NVML on a CPU actor) is not set, never set to zero.

Ray drops a gauge series that is not set again within two export intervals, so while the sweep runs a
thread sets every gauge's last value again each second; after `close()` they age out, as a finished
sweep's gauges should.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter as Tally
from collections import deque
from typing import Callable, TextIO

from ray.util.metrics import Counter, Gauge

from cluster.contracts.shard import ActorState

TICK_EVERY_S = 1.0  # progress is told what the sweep is doing at most this often
RATE_WINDOW_S = 30.0  # the log line's samples/s and ETA: over the results of the last this many seconds


class LogProgress:
    """Progress as periodic log lines. Their rate is that of the last RATE_WINDOW_S: a rate since the start
    would count the engines' start (and replayed rows, done at once) as work, and its ETA would grow while
    engines start and stay too long once they run. No rate (`? samples/s, ETA ?`) until two results within the
    window; `ETA 0s` once every sample planned so far is done."""

    def __init__(self, total: int, log: Callable[[str], None], every_s: float = 2.0):
        self.total, self.log, self.every_s = total, log, every_s
        self.done, self.last = 0, 0.0
        self._results: deque[tuple[float, int]] = deque()  # (when, samples done then), the window's results

    def grow(self, n: int) -> None:
        """More samples planned (planning runs while the first shards do)."""
        self.total += n

    def add(self, n: int, shard_id: str) -> None:
        self.done += n
        now = time.perf_counter()
        self._results.append((now, self.done))
        if now - self.last >= self.every_s or self.done >= self.total:
            self._line(f"last: {shard_id}")

    def tick(self, doing: str) -> None:
        """Called while the sweep waits: a line when none came for `every_s`, saying what is going on."""
        if time.perf_counter() - self.last >= self.every_s:
            self._line(doing)

    def _rate(self, now: float) -> float:
        """Samples a second from the window's first result to now; 0 with fewer than two results in it."""
        while self._results and now - self._results[0][0] > RATE_WINDOW_S:
            self._results.popleft()
        if len(self._results) < 2:
            return 0.0
        first, done_then = self._results[0]
        return (self.done - done_then) / max(now - first, 1e-9)

    def _line(self, tail: str) -> None:
        now = self.last = time.perf_counter()
        if not self.total:  # planning has not cut its first shard
            self.log(f"[raysweep] no samples planned yet — {tail}")
            return
        rate = self._rate(now)
        speed = f"{rate:.1f} samples/s" if rate > 0 else "? samples/s"  # unknown, not zero: one result so far
        if self.done >= self.total:
            eta = "ETA 0s"
        else:
            eta = f"ETA {(self.total - self.done) / rate:.0f}s" if rate > 0 else "ETA ?"
        self.log(f"[raysweep] {self.done}/{self.total} samples ({100 * self.done / self.total:.0f}%) "
                 f"{speed}, {eta} — {tail}")

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

    @property
    def total(self) -> int:
        return self.bar.total

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


def state_counts(slots: list, waiting: set[int] = frozenset()) -> dict[str, int]:
    """Actors by state (importing, idle, starting, running: cluster/contracts/shard.py ActorState), by name; engines
    lent to the sweep (the pool's, or kept ones) as `lent`; importing actors that Ray has not placed yet (`waiting`,
    slot numbers: cluster/schedule/placement_wait.py) as `waiting to be placed`."""
    counts: dict[str, int] = {}
    for slot in slots:
        importing = slot.state is ActorState.IMPORTING
        state = "lent" if slot.lent else "waiting to be placed" if importing and slot.number in waiting else \
            slot.state.value
        counts[state] = counts.get(state, 0) + 1
    return counts


class Ticks:
    """What the sweep is doing, for the progress line: once a second at most (the scheduler's loop turns every
    50 ms while planning, and once per result)."""

    def __init__(self, progress, watch=None, every_s: float = TICK_EVERY_S):
        """`watch`: which actors wait to be placed (cluster/schedule/placement_wait.py PlacementWatch)."""
        self.progress, self.watch, self.every_s = progress, watch, every_s
        self._ticked = 0.0  # when it last told the progress

    def tick(self, slots: list, shards_in_flight: int, planning: bool) -> bool:
        """Tell the progress, unless it was told less than `every_s` ago; True where it was told now."""
        now = time.perf_counter()
        if now - self._ticked < self.every_s:
            return False
        self._ticked = now
        if self.watch is not None:
            self.watch.look(slots)
        counts = state_counts(slots, self.watch.waiting if self.watch is not None else frozenset())
        doing = ", ".join(f"{n} actor(s) {state}" for state, n in sorted(counts.items()) if n) or "no actors yet"
        self.progress.tick(f"{doing}; {shards_in_flight} shard(s) in flight" + ("; planning" if planning else ""))
        return True


_TASK = ("sweep", "model", "task")
_ACTOR = ("sweep", "model", "task", "actor")

NAMES = ("raysweep_samples_done", "raysweep_output_tokens", "raysweep_output_tokens_per_s",
         "raysweep_shards_in_flight", "raysweep_shards_done", "raysweep_shards_failed",
         "raysweep_shard_attempts_failed", "raysweep_gpu_memory_used_mib")


class SweepMetrics:
    """One per sweep run on the driver; the scheduler's events call the methods below."""

    def __init__(self, sweep: str):
        self.sweep = sweep
        self.samples = Counter("raysweep_samples_done", "Samples with a committed result.", _ACTOR)
        self.tokens = Counter("raysweep_output_tokens", "Output tokens generated in committed shards.", _ACTOR)
        self.tok_per_s = Gauge("raysweep_output_tokens_per_s", "Output tok/s of the actor's last shard.", _ACTOR)
        self.in_flight = Gauge("raysweep_shards_in_flight", "Shards sent to actors and not yet back.", _TASK)
        self.done = Counter("raysweep_shards_done", "Shards committed.", _ACTOR)
        self.failed = Counter("raysweep_shards_failed", "Shards that failed every attempt.", _TASK)
        self.attempts_failed = Counter("raysweep_shard_attempts_failed", "Shard attempts that failed.", _TASK)
        self.gpu_memory = Gauge("raysweep_gpu_memory_used_mib", "The actor's GPU memory used (NVML), MiB.",
                                ("sweep", "model", "actor"))
        self._in_flight: Tally = Tally()
        self._gauges: dict[tuple, float] = {}  # (gauge, frozen tags) -> last value, set again each second
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, name="raysweep-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _keep_alive(self, every_s: float = 1.0) -> None:
        while not self._stop.wait(every_s):
            with self._lock:
                values = list(self._gauges.items())
            for (gauge, tags), value in values:
                gauge.set(value, tags=dict(tags))

    def _set(self, gauge: Gauge, value: float, tags: dict) -> None:
        with self._lock:
            self._gauges[gauge, tuple(sorted(tags.items()))] = value
        gauge.set(value, tags=tags)

    def _tags(self, model: str, task: str, actor: str | None = None) -> dict:
        tags = {"sweep": self.sweep, "model": model, "task": task}
        return tags if actor is None else {**tags, "actor": actor}

    def _set_in_flight(self, model: str, task: str, change: int) -> None:
        self._in_flight[model, task] += change
        self._set(self.in_flight, self._in_flight[model, task], self._tags(model, task))

    def dispatched(self, model: str, task: str) -> None:
        self._set_in_flight(model, task, +1)

    def returned(self, model: str, task: str) -> None:
        """A shard came back from an actor, with a result or an error."""
        self._set_in_flight(model, task, -1)

    def committed(self, model: str, task: str, telemetry: dict) -> None:
        tags = self._tags(model, task, telemetry["actor_id"])
        self.samples.inc(telemetry["n_samples"], tags=tags)
        self.done.inc(1, tags=tags)
        if telemetry["output_tokens"]:
            self.tokens.inc(telemetry["output_tokens"], tags=tags)
        if telemetry["output_tok_per_s"] is not None:
            self._set(self.tok_per_s, telemetry["output_tok_per_s"], tags)

    def gpu_reading(self, model: str, sample: dict) -> None:
        self._set(self.gpu_memory, sample["mem_used_mib"],
                  {"sweep": self.sweep, "model": model, "actor": sample["actor_id"]})

    def attempt_failed(self, model: str, task: str) -> None:
        self.attempts_failed.inc(1, tags=self._tags(model, task))

    def shard_failed(self, model: str, task: str) -> None:
        self.failed.inc(1, tags=self._tags(model, task))
