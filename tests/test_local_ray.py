"""jobs/local_ray.py: a command's own local Ray starts no idle workers ahead, and its stop leaves no Ray process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jobs.local_ray import PRESTART, local_options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# in a process of its own (the session's Ray may be up in this one): a local Ray started with local_options(),
# the idle workers its raylet has 3 s later, the Ray processes it started, and which of them outlive shutdown()
PROBE = """
import json, os, sys, time
import psutil, ray
from ray._private import worker
from jobs import local_ray

ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **local_ray.local_options())
started = {kind: [i.process.pid for i in infos] for kind, infos in worker._global_node.all_processes.items()}
raylet = psutil.Process(started["raylet"][0])
idle, deadline = 0, time.monotonic() + 3
while time.monotonic() < deadline:
    idle = sum("IDLE" in " ".join(p.cmdline()) for p in raylet.children())
    time.sleep(0.2)
local_ray.shutdown()
alive = [pid for pids in started.values() for pid in pids if psutil.pid_exists(pid)
         and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
print(json.dumps({"kinds": sorted(started), "idle": idle, "alive": alive}))
"""


def _probe(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != f"RAY_{PRESTART}"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**env, **extra})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_users_prestart_setting_is_kept(monkeypatch):
    monkeypatch.delenv(f"RAY_{PRESTART}", raising=False)
    assert local_options() == {"_system_config": {PRESTART: False}}
    monkeypatch.setenv(f"RAY_{PRESTART}", "1")
    assert local_options() == {}


@pytest.mark.slow
def test_a_commands_local_ray_starts_no_idle_workers_and_stops_whole():
    ours = _probe({})
    assert "monitor" in ours["kinds"]  # the process shutdown() kills first: Ray 2.60 starts one per local node
    assert ours["idle"] == 0
    assert ours["alive"] == []
    # the same probe with Ray's own default: idle workers do start (the count above can see them)
    default = _probe({f"RAY_{PRESTART}": "1"})
    assert default["idle"] >= 1
    assert default["alive"] == []
