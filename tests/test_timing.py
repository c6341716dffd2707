"""The command's clock (jobs.started_at, cluster/contracts/timing.py): it starts at the Python interpreter's start.

`bash -c "sleep 3 && raysweep run ..."` forks `sleep`, waits, then execs into raysweep: the process raysweep runs in
is the shell's, and /proc's start time (its fork) is before the sleep. The figures "after the command started", the
manifest's `runs` and the report's timeline counted the sleep; they must not, while Python's own start still counts
where nothing ran before it."""

import re
import subprocess
import sys
import time

from tests.conftest import ROOT

SLEEP_S = 3.0
# the started-at figures here: the interpreter's start against /proc's fork time (a clock tick, 10 ms, apart), and
# the shell's CPU before its exec, counted as Python's (milliseconds)
SLACK_S = 0.3

CLOCKS = ("import time, jobs; from cluster.contracts.timing import process_started_at; now = time.time(); "
          "print(now - jobs.started_at(), now - process_started_at(), now - jobs._ENTERED_AT)")


def _after_a_sleep(command: str) -> tuple[float, str]:
    """`command` run as a shell's last command after `sleep SLEEP_S` (bash execs into it): the test's own wall
    seconds from starting the shell to after the sleep's end (the most the command itself can have taken), and
    what the command printed."""
    started = time.time()
    proc = subprocess.run(["bash", "-c", f"sleep {SLEEP_S:g} && {command}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return time.time() - started - SLEEP_S, proc.stdout + proc.stderr


def test_a_shells_sleep_before_the_exec_is_not_counted():
    at_most, out = _after_a_sleep(f"{sys.executable} -c '{CLOCKS}'")
    since_start, since_fork, since_entry = map(float, out.split())
    assert since_fork >= SLEEP_S  # the process was the shell's: /proc's start time is from before the sleep
    assert since_entry <= since_start <= at_most + SLACK_S  # Python's start-up counted, the sleep not


def test_pythons_own_start_counts_when_nothing_ran_before_it():
    proc = subprocess.run([sys.executable, "-c", CLOCKS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    since_start, since_fork, since_entry = map(float, proc.stdout.split())
    assert abs(since_start - since_fork) <= SLACK_S  # from the process's creation: Python's start is inside
    assert since_start >= since_entry


def test_the_process_creation_time_is_not_rounded_to_the_second():
    """/proc/stat's btime is whole seconds: a start time computed from it was up to 1 s early."""
    code = "from cluster.contracts.timing import process_started_at; print(process_started_at())"
    before = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert before - 0.05 <= float(proc.stdout) <= time.time()


def test_the_sweeps_printed_times_leave_the_shells_sleep_out(tmp_path):
    """The real command: `raysweep run` (python -m jobs.cli) after a sleep, stopped by a Ray address nothing answers
    at, after it printed its first time ("inputs checked ... (Xs after the command started)")."""
    (tmp_path / "qa.jsonl").write_text('{"id": "r0", "question": "1+1", "answer": "2"}\n')
    (tmp_path / "sweep.yaml").write_text(
        "name: t\nmodels: [{name: tiny, path: 'builtin:tiny'}]\ntasks:\n  - {name: qa, data: qa.jsonl, id_column: id, "
        "prompt: '{question}', target: answer, scorer: exact_match, sampling: {max_tokens: 2}}\n")
    at_most, out = _after_a_sleep(f"{sys.executable} -m jobs.cli run {tmp_path / 'sweep.yaml'} "
                                  f"--output {tmp_path / 'out'} --address 127.0.0.1:1")
    printed = re.search(r"inputs checked: .*\((\d+\.\d)s after the command started\)", out)
    assert printed, out
    assert float(printed[1]) <= at_most + SLACK_S, out
