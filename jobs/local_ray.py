"""A local Ray that a raysweep command starts for itself: what it starts with, and its stop.

- `local_options()`: no idle workers started ahead (Ray's `prestart_worker_first_driver`). When the first
  driver connects, Ray starts one idle Python worker per CPU (16 on a 16-core GPU machine), each importing
  Ray at the moment the engine host imports vLLM and the driver plans; a sweep's few actors start workers of
  their own all the same. On a 2-core machine the quickstart took 11.6-12.3 s without them against 12.7-14.3 s
  with them (three runs each, interleaved). `RAY_prestart_worker_first_driver` set in the environment
  is the user's and is kept.
- `shutdown()`: `ray.shutdown`, with Ray's autoscaler monitor killed first where this process started the
  node. Ray (2.60) stops its GCS before the monitor, whose SIGTERM handler then tries to report to the gone
  GCS until Ray kills it a second later: 1.0 s of a local command's 1.4 s shutdown, every run.
"""

from __future__ import annotations

import os

PRESTART = "prestart_worker_first_driver"


def local_options() -> dict:
    """ray.init's extra arguments for a new local Ray."""
    if f"RAY_{PRESTART}" in os.environ:
        return {}
    return {"_system_config": {PRESTART: False}}


def shutdown() -> None:
    """ray.shutdown, without the monitor's second (a no-op where Ray is not up, as ray.shutdown is)."""
    import ray
    from ray._private import worker  # Ray is pinned (pyproject.toml); tests/test_local_ray.py checks this

    node = worker._global_node
    for info in (getattr(node, "all_processes", None) or {}).get("monitor", []):
        try:
            info.process.kill()  # SIGKILL: what Ray sends it a second later anyway
        except OSError:
            pass
    ray.shutdown()
