"""Every test of the suite is bounded (pyproject.toml's `timeout`, pytest-timeout): a test that waits on something
that never ends fails at the bound with its stacks printed, its own cleanup runs (the child it started is ended),
and the tests after it still run."""

import os
import subprocess
import sys

HANGS = '''
import os, subprocess, sys

def test_waits_on_a_child_that_never_ends():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["CHILD_PID"], "w") as f:
        f.write(str(child.pid))
    try:
        child.wait()
    finally:
        child.kill()
        child.wait()

def test_after_it():
    pass
'''


def test_the_suite_bounds_every_test(request):
    assert request.config.getini("timeout_method") == "signal"  # the test fails; its teardown runs
    assert 300 <= float(request.config.getini("timeout")) <= 1800  # generous: a bound on hangs, not on speed


def test_a_test_that_hangs_fails_at_the_bound_its_cleanup_runs_and_the_next_one_runs(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    pid_file = tmp_path / "child.pid"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=3",
                           "-o", "timeout_method=signal", "test_hangs.py"], cwd=tmp_path,
                          env=os.environ | {"CHILD_PID": str(pid_file)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "Timeout (>3.0s)" in done.stdout and "1 failed, 1 passed" in done.stdout, done.stdout[-3000:]
    assert "child.wait()" in done.stdout  # where it hung, from the stacks
    child = int(pid_file.read_text())
    try:
        os.kill(child, 0)
        alive = open(f"/proc/{child}/stat").read().split(") ")[-1][0] != "Z"
    except ProcessLookupError:
        alive = False
    assert not alive  # the test's own cleanup ended it
