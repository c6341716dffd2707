"""Ray metrics: a local sweep, scraped from the node's Prometheus endpoint (what a Prometheus server and
the Ray dashboard's Metrics view read) while it runs and after; every metric is there, tagged, non-zero."""

import re
import threading
import time
import urllib.request

import ray

from cluster.metrics import NAMES
from cluster.run import run_sweep
from cluster.spec import load_spec
from tests.conftest import QUICKSTART

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


def test_sweep_metrics_on_the_prometheus_endpoint(ray_local, tmp_path):
    url = metrics_url()
    spec = load_spec(QUICKSTART)
    peak: dict[tuple[str, str], float] = {}  # the largest value each series showed
    running = threading.Event()
    running.set()

    def watch():
        while running.is_set():
            for key, value in scrape(url, spec.name).items():
                peak[key] = max(value, peak.get(key, value))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        report = run_sweep(spec, output=str(tmp_path / "out"), log=lambda line: None)
        deadline = time.monotonic() + 30  # counters are exported every second; let the last ones land
        while time.monotonic() < deadline and sum(v for (name, _), v in peak.items()
                                                  if name == "ray_raysweep_samples_done_total") < 350:
            time.sleep(0.5)
    finally:
        running.clear()
        watcher.join()
    assert report.samples == 350 and not report.failed

    def series(name):
        return {tags: v for (n, tags), v in peak.items() if n == name}

    done = series("ray_raysweep_samples_done_total")
    assert sum(done.values()) == 350, done  # every sample counted once, over tasks and actors
    assert {re.search(r'task="(\w+)"', t).group(1) for t in done} == {"arithmetic", "choice", "extract"}
    assert all('model="tiny"' in t for t in done)
    assert len({re.search(r'actor="(\w+)"', t).group(1) for t in done}) == 2
    assert sum(series("ray_raysweep_shards_done_total").values()) == 7
    assert min(series("ray_raysweep_output_tokens_total").values()) > 0
    assert min(series("ray_raysweep_output_tokens_per_s").values()) > 0
    assert max(series("ray_raysweep_shards_in_flight").values()) >= 1  # seen while shards were out
    # the rest are exported once there is something to count: no NVML here, no failure in this run
    shown = {n for n, _ in peak}
    assert shown == {f"ray_{n}" + ("_total" if n not in ("raysweep_output_tokens_per_s", "raysweep_shards_in_flight",
                                                         "raysweep_gpu_memory_used_mib") else "")
                     for n in NAMES} - {"ray_raysweep_shards_failed_total", "ray_raysweep_shard_attempts_failed_total",
                                        "ray_raysweep_gpu_memory_used_mib"}
