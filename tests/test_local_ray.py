"""jobs/local_ray.py: a command's own local Ray stops whole, its autoscaler monitor killed first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# in a process of its own (the session's Ray may be up in this one): a local Ray, the processes it started,
# whether the monitor was among them and was gone before ray.shutdown began, and which outlive shutdown()
PROBE = """
import json
import ray
from ray._private import worker
from jobs import local_ray

def running(pid):  # alive and not a zombie (Linux: /proc)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
started = {kind: [i.process for i in infos] for kind, infos in worker._global_node.all_processes.items()}
monitor_at_shutdown = []
real_shutdown = ray.shutdown
def shutdown(*args, **kwargs):
    monitor_at_shutdown.extend(p.poll() is None for p in started.get("monitor", []))
    return real_shutdown(*args, **kwargs)
ray.shutdown = shutdown
local_ray.shutdown()
alive = [p.pid for ps in started.values() for p in ps if running(p.pid)]
print(json.dumps({"kinds": sorted(started), "monitor_running_at_shutdown": monitor_at_shutdown, "alive": alive}))
"""


@pytest.mark.slow
def test_a_commands_local_ray_stops_whole_its_monitor_killed_first():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert "monitor" in probe["kinds"]  # Ray 2.60 starts one per local node: the second this saves
    assert probe["monitor_running_at_shutdown"] == [False]
    assert probe["alive"] == []
