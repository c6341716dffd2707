"""The suite's xdist groups are real (tests/conftest.py): under `-n 2 --dist loadgroup` every test of a file runs
on one worker, so its module fixtures are made once and the sandbox's files never run side by side (conftest's
hook marks the groups before pytest-xdist names each test by the group it finds marked)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_files_tests_run_on_one_worker_under_its_group():
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider", "-m", "not slow", "tests/test_lifecycle.py", "tests/test_progress.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*PASSED (tests/\S+?)::\S+@(\S+)", done.stdout, re.M)
    assert len(ran) >= 8, done.stdout[-3000:]
    for path, group in {(p, g) for _, p, g in ran}:
        assert group == Path(path).name
        assert len({w for w, p, _ in ran if p == path}) == 1, path  # one worker
