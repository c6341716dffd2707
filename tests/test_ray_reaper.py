"""jobs/ray_reaper.py: what a killed driver started is killed; what a driver that released its reaper started is not;
nothing but the driver's descendants is touched."""

import os
import signal
import subprocess
import sys
import time
import uuid

from tests.conftest import ROOT

# a driver: its reaper, then a grandchild in a session of its own (as Ray's agents: out of reach of a signal to the
# driver's group, and left to init once its parent is gone); its pids printed, then it waits to be killed or releases
DRIVER = """
import subprocess, sys, time
from jobs.ray_reaper import Reaper
reaper = Reaper()
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', sys.argv[1]], "
                          "start_new_session=True); time.sleep(120)", sys.argv[1]])
time.sleep(1.5)  # the reaper notes the grandchild (it looks every REAPER_LOOK_S)
print(reaper.process.pid, flush=True)
if sys.argv[2] == "release":
    child.kill()
    reaper.release()
    print("released", flush=True)
else:
    time.sleep(120)
"""


def _naming(token: str) -> set[int]:
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.add(int(pid))
        except OSError:
            pass
    return found


def _driver(token: str, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, token, how], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})


def _gone_within(pids, seconds: float) -> bool:
    give_up = time.monotonic() + seconds
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < give_up:
        time.sleep(0.1)
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_a_killed_driver_s_descendants_are_killed_and_the_reaper_ends():
    token = uuid.uuid4().hex
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", token])  # not the driver's
    driver = _driver(token, "wait")
    try:
        reaper = int(driver.stdout.readline())
        started = _naming(token) - {bystander.pid, driver.pid}
        assert len(started) == 2, started  # the driver's child and its grandchild
        driver.kill()
        driver.wait()
        give_up = time.monotonic() + 15  # a bound on a hang: the reaper ends them in about a second
        while _naming(token) - {bystander.pid} and time.monotonic() < give_up:
            time.sleep(0.1)
        assert _naming(token) == {bystander.pid}
        assert _gone_within([reaper], 15)
    finally:
        bystander.kill()
        bystander.wait()
        for pid in _naming(token):
            os.kill(pid, signal.SIGKILL)


def test_a_released_reaper_ends_and_kills_nothing():
    token = uuid.uuid4().hex
    driver = _driver(token, "release")
    try:
        reaper = int(driver.stdout.readline())
        assert driver.stdout.readline() == "released\n"
        assert _gone_within([reaper], 15)
        driver.wait(timeout=30)
        time.sleep(1)  # longer than the reaper's look: it would have killed by now
        assert len(_naming(token)) == 1  # the grandchild, in its own session, outlived the driver as it would have
    finally:
        for pid in _naming(token):
            os.kill(pid, signal.SIGKILL)
