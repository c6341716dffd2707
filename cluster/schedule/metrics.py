"""The sweep's live metrics, through `ray.util.metrics`: Ray exports them on every node's Prometheus
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

import threading
from collections import Counter as Tally

from ray.util.metrics import Counter, Gauge

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
