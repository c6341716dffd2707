"""Ray metrics: a local sweep, scraped from the node's Prometheus endpoint (what a Prometheus server and
the Ray dashboard's Metrics view read) while it runs and after; every metric is there, tagged, non-zero."""

import os
import re
import threading
import time
import urllib.request
from dataclasses import replace

import pyarrow.parquet as pq
import pytest

import ray

from cluster.schedule.progress import NAMES
from cluster.schedule.run import run_sweep
from cluster.inputs.spec_file import load_spec
from tests.conftest import LEAN_EXTRACT_ROWS, lean_quickstart

SERIES = re.compile(r"(ray_raysweep_\w+)\{(.*)\} (\S+)$")


def metrics_url() -> str:
    """This node's Prometheus endpoint."""
    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def scrape(url: str, sweep: str) -> dict[tuple[str, str], float]:
    """{(metric, tags): value} for this sweep's series."""
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    found = {}
    for line in body.splitlines():
        m = SERIES.match(line)
        if m and f'sweep="{sweep}"' in m.group(2):
            tags = ",".join(t for t in m.group(2).split(",") if t.split("=")[0] in ("sweep", "model", "task", "actor"))
            found[m.group(1), tags] = float(m.group(3))
    return found


class MetricsWatcher:
    """Scrapes this node's endpoint every 0.3 s on a thread while in `with`, keeping the largest value
    each of the sweep's series showed (gauges age out of Ray's endpoint soon after a sweep ends)."""

    def __init__(self, sweep: str):
        self.url, self.sweep = metrics_url(), sweep
        self.peak: dict[tuple[str, str], float] = {}
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "MetricsWatcher":
        self._running.set()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._running.clear()
        self._thread.join()

    def _watch(self) -> None:
        while self._running.is_set():
            for key, value in scrape(self.url, self.sweep).items():
                self.peak[key] = max(value, self.peak.get(key, value))
            time.sleep(0.3)

    def series(self, name: str) -> dict[str, float]:
        return {tags: v for (n, tags), v in self.peak.items() if n == name}

    def total(self, name: str) -> float:
        return sum(self.series(name).values())

    def wait_for_total(self, name: str, value: float, timeout_s: float = 30) -> None:
        """Counters are exported every second; let the last increments land."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.total(name) < value:
            time.sleep(0.5)


@pytest.mark.slow
def test_sweep_metrics_on_the_prometheus_endpoint(engine_host, ray_local, tmp_path):
    # 150 + 100 + 30 samples in 3 + 2 + 1 shards; a name of its own: other tests' quickstarts on this session's
    # Ray leave their series in the same endpoint
    spec = replace(load_spec(lean_quickstart(tmp_path)), name=f"metrics-{os.getpid()}-{time.time_ns()}")
    samples = 250 + LEAN_EXTRACT_ROWS
    with MetricsWatcher(spec.name) as watcher:
        report = run_sweep(spec, output=str(tmp_path / "out"), engine_host=engine_host, log=lambda line: None)
        watcher.wait_for_total("ray_raysweep_samples_done_total", samples)
    assert report.samples == samples and not report.failed

    done = watcher.series("ray_raysweep_samples_done_total")
    assert sum(done.values()) == samples, done  # every sample counted once, over tasks and actors
    assert {re.search(r'task="(\w+)"', t).group(1) for t in done} == {"arithmetic", "choice", "extract"}
    assert all('model="tiny"' in t for t in done)
    # one series per actor that ran shards (the first engine up may run them all before the second is)
    ran = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet", columns=["actor_id"])
    assert {re.search(r'actor="(\w+)"', t).group(1) for t in done} == set(ran["actor_id"].to_pylist())
    assert watcher.total("ray_raysweep_shards_done_total") == 6
    assert min(watcher.series("ray_raysweep_output_tokens_total").values()) > 0
    assert min(watcher.series("ray_raysweep_output_tokens_per_s").values()) > 0
    assert max(watcher.series("ray_raysweep_shards_in_flight").values()) >= 1  # seen while shards were out
    # the rest are exported once there is something to count: no NVML here, no failure in this run
    gauges = ("raysweep_output_tokens_per_s", "raysweep_shards_in_flight", "raysweep_gpu_memory_used_mib")
    shown = {n for n, _ in watcher.peak}
    assert shown == {f"ray_{n}" + ("" if n in gauges else "_total") for n in NAMES} - {
        "ray_raysweep_shards_failed_total", "ray_raysweep_shard_attempts_failed_total",
        "ray_raysweep_gpu_memory_used_mib"}
