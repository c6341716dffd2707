"""Ctrl-C (to the process group, as a terminal sends it) and SIGTERM (to the driver) at three moments of a
quickstart run, its extract task cut to 30 rows (during Ray's start, once engines are up, with shards half
done): one line saying what was committed and how to resume, exit 1, no traceback, no Ray process left behind;
and the same command then resumes to every sample exactly once (not tracebacks, Ray's C++ dump with exit
-6, or Ray processes left behind)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pyarrow.parquet as pq
import pytest

from tests.conftest import LEAN_EXTRACT_ROWS, ROOT, lean_quickstart

MOMENTS = {  # the line after which the signal is sent
    "ray start": lambda line: "starting a local Ray" in line,
    "engines up": lambda line: "engine up:" in line,
    "mid-shards": lambda line: "samples (" in line and "] 0/" not in line,
}


def _raylets(ray_dir: str) -> set[int]:
    """The raylets of the Rays started under `ray_dir` (the run's RAY_TMPDIR): not another test's, running
    meanwhile on another xdist worker or beside the suite."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout  # -ww: whole lines
    return {int(line.split()[0]) for line in out.splitlines()[1:] if "/raylet/raylet " in line and ray_dir in line}


@pytest.fixture
def ray_dir():
    """A short folder of its own for the run's Ray (RAY_TMPDIR; Ray's socket paths must stay under 108 bytes)."""
    made = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _read_until(sweep: subprocess.Popen, moment: str) -> list[str]:
    """The run's lines up to and including the first that marks `moment` (MOMENTS)."""
    lines = []
    for line in sweep.stdout:
        lines.append(line)
        if MOMENTS[moment](line):
            break
    return lines


# Ctrl-C "0.1 s after the start": while Python imports raysweep. On a loaded machine the interpreter's own start
# can take longer; a signal there is Python's, before any line of raysweep runs: in site's .pth files ("Fatal
# Python error: init_import_site") or in runpy's frames (a KeyboardInterrupt naming no file of the repository).
# A new process is signalled then, later each time.
EARLY_PAUSES_S = (0.1, 0.4, 1.0, 2.5)


def _running_the_command(pid: int, timeout_s: float = 60) -> None:
    """Until the child runs the command (`python -m jobs...`), not the test's own fork of itself: a signal between
    the fork and the exec is taken by the test's handler, copied into the child, and lost at the exec (seen at a
    load of 25: the run went on to its end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"jobs." in f.read():
                    return
        except OSError:  # ended already, or no /proc: signalled as it is
            return
        time.sleep(0.002)


def _signal_masks(pid: int) -> str:
    """The SigBlk, SigIgn and SigCgt lines of /proc/PID/status (bit 2 of each: SIGINT), or why not."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "; ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError as e:
        return f"unreadable ({e})"


def _catches_sigint(masks: str) -> bool:
    """Whether _signal_masks's SigCgt says a handler was set for SIGINT (True where it cannot say)."""
    for part in masks.split(";"):
        name, _, value = part.strip().partition(":")
        if name == "SigCgt":
            return bool(int(value.strip(), 16) & (1 << (signal.SIGINT - 1)))
    return True


def ctrl_c_early(start) -> tuple[subprocess.Popen, str]:
    """SIGINT to the process group of `start()`, EARLY_PAUSES_S[0] after it began (see above); what it printed.
    The child starts with SIGINT's default action, as a terminal's shell starts it: a test run started in the
    background of a non-interactive shell has SIGINT ignored, an ignored signal stays ignored across exec, Python
    then installs no handler of its own, and a Ctrl-C before raysweep's first line was lost (seen at a load of 14:
    the child's SigIgn 0x1001007 when the signal was sent, and the run went to its end)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _ctrl_c_early(start)
    finally:
        signal.signal(signal.SIGINT, before)


def _ctrl_c_early(start) -> tuple[subprocess.Popen, str]:
    for pause in EARLY_PAUSES_S:
        process = start()
        _running_the_command(process.pid)
        time.sleep(pause)
        masks = _signal_masks(process.pid)
        os.killpg(process.pid, signal.SIGINT)
        printed, _ = process.communicate(timeout=120)
        if "[raysweep] stopped by SIGINT" not in printed:  # what the child did with SIGINT when it was sent
            printed += f"\n[test] the child's signal masks when SIGINT was sent, {pause} s in: {masks}\n"
        pythons = "init_import_site" in printed or ("KeyboardInterrupt" in printed and str(ROOT) not in printed)
        # or Python had not yet set its SIGINT handler (SigCgt's SIGINT bit clear): the default action ended it,
        # silently, before raysweep's first line ran (seen under load: exit -2, nothing printed)
        pythons = pythons or (process.returncode == -signal.SIGINT and not _catches_sigint(masks))
        if not pythons:
            break
    return process, printed


# a stop line's end mid-sweep: what is left resumes, or (the signal landing after the last commit, as a loaded
# machine may delay it) every shard is committed
RESUMED_OR_DONE = ("; the same command resumes the rest", "; its summary is written as it stops")


def _run(out, ray_dir: str, env=None) -> subprocess.Popen:
    """The quickstart, its extract task cut to LEAN_EXTRACT_ROWS rows (tests/conftest.py lean_quickstart)."""
    spec = out.parent / "quickstart.yaml"
    if not spec.exists():
        lean_quickstart(out.parent)
    return subprocess.Popen([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1", "RAY_ADDRESS": "", "RAY_TMPDIR": ray_dir}
                            | (env or {}))


@pytest.mark.slow
@pytest.mark.parametrize("moment, signum", [("ray start", signal.SIGINT), ("engines up", signal.SIGTERM),
                                            ("mid-shards", signal.SIGTERM)], ids=["SIGINT-ray start",
                                                                                 "SIGTERM-engines up",
                                                                                 "SIGTERM-mid-shards"])
def test_a_signal_at_any_moment_ends_the_run_in_one_line_and_leaves_no_ray_behind(tmp_path, ray_dir, moment, signum):
    """Each moment once, each signal as it comes: SIGINT (a terminal's Ctrl-C) and SIGHUP (a closed terminal) to
    the whole process group, SIGTERM (`kill PID`, `ray job stop`) to the driver alone. SIGINT mid-shards: the
    Ctrl-C twice test; SIGHUP: the closed terminal's."""
    sweep = _run(tmp_path / "out", ray_dir)
    lines, noted = [], {}
    for line in sweep.stdout:
        lines.append(line)
        if MOMENTS[moment](line):
            if moment != "ray start":  # the run's Ray is up, and seen under its own folder
                assert _raylets(ray_dir), "no raylet of this run's Ray found: the check below would see none"
            noted = _descendants(sweep.pid)
            if signum in (signal.SIGINT, signal.SIGHUP):
                os.killpg(sweep.pid, signum)
            else:
                os.kill(sweep.pid, signum)
            break
    rest, _ = sweep.communicate(timeout=180)
    text = "".join(lines) + rest
    name = signal.Signals(signum).name
    assert sweep.returncode == 1, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith(f"[raysweep] stopped by {name}: ")]
    # at Ray's start no shard is planned yet (planning begins with Ray up): the line says nothing is committed
    endings = ("; nothing was committed, and the same command starts the sweep",) if moment == "ray start" else \
        RESUMED_OR_DONE
    assert len(stopped) == 1 and stopped[0].endswith(endings), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    deadline = time.time() + 30
    while _raylets(ray_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert not _raylets(ray_dir)  # the local Ray this run started is gone with it
    left = _left_running(noted, within_s=15)  # nor any other process it started (a bound on a hang)
    assert not left, [_command_line(pid)[:100] for pid in left]
    if moment == "mid-shards" and signum == signal.SIGTERM:  # what was committed is kept: the rest resumes
        again = _run(tmp_path / "out", ray_dir)
        text, _ = again.communicate(timeout=300)
        assert again.returncode == 0, text[-3000:]
        assert "already committed" in text
        ids = pq.read_table(tmp_path / "out" / "results", columns=["task", "sample_id"]).to_pylist()
        assert len(ids) == len({(r["task"], r["sample_id"]) for r in ids}) == 250 + LEAN_EXTRACT_ROWS


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["0.1 s after the start", "twice, 0.15 s apart"])
def test_ctrl_c_at_the_start_or_twice_is_one_line(tmp_path, ray_dir, moment):
    """Ctrl-C 0.1 s after the start (Python still importing: its KeyboardInterrupt traceback), or twice 0.15 s apart
    mid-shards (the second during the cleanup): one `stopped by SIGINT` line, no traceback, no process left. A
    signal that lands in the interpreter's own start, before raysweep's first line runs, is Python's: that attempt
    is made again, later (`ctrl_c_early`)."""
    lines, noted = [], {}
    if moment == "0.1 s after the start":
        sweep, rest = ctrl_c_early(lambda: _run(tmp_path / "out", ray_dir))
    else:
        sweep = _run(tmp_path / "out", ray_dir)
        for line in sweep.stdout:
            lines.append(line)
            if MOMENTS["mid-shards"](line):
                break
        noted = _descendants(sweep.pid)
        os.killpg(sweep.pid, signal.SIGINT)
        time.sleep(0.15)
        os.killpg(sweep.pid, signal.SIGINT)
        rest, _ = sweep.communicate(timeout=120)
    text = "".join(lines) + rest
    stopped = [line for line in text.splitlines() if line.startswith("[raysweep] stopped by SIGINT: ")]
    assert len(stopped) == 1, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert sweep.returncode in (1, 130), text[-3000:]  # 130: the second came during the cleanup, which it cut short
    assert not _left_running(noted, within_s=15), "a process of the run outlived it"


@pytest.mark.slow
def test_sighup_from_a_closed_terminal_ends_the_run_in_one_line_as_sigterm_does(tmp_path, ray_dir):
    """SIGHUP to the process group ended the run with no line (rc -1) and left Ray's agents running."""
    test_a_signal_at_any_moment_ends_the_run_in_one_line_and_leaves_no_ray_behind(tmp_path, ray_dir, "mid-shards",
                                                                                  signal.SIGHUP)


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_ends_the_run_in_one_line_without_waiting_for_its_dead_ray(tmp_path, ray_dir):
    """`kill -TERM -- -PGID` (what `timeout`, a shell's job control or a container stop send) also ends the local
    Ray this run started: its GCS is gone, and a cleanup that made Ray calls would wait Ray's 60 s for it, then
    abort the process with a C++ message and no line of ours."""
    sweep = _run(tmp_path / "out", ray_dir)
    lines = []
    for line in sweep.stdout:
        lines.append(line)
        if MOMENTS["mid-shards"](line):
            assert _raylets(ray_dir), "no raylet of this run's Ray found: the check below would see none"
            os.killpg(sweep.pid, signal.SIGTERM)
            signalled = time.monotonic()
            break
    rest, _ = sweep.communicate(timeout=180)
    took = time.monotonic() - signalled
    text = "".join(lines) + rest
    assert sweep.returncode == 1, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("[raysweep] stopped by SIGTERM: ")]
    assert len(stopped) == 1 and stopped[0].endswith(RESUMED_OR_DONE), text[-3000:]
    assert "Failed to connect to GCS" not in text and "Traceback" not in text, text[-3000:]
    # no wait for Ray's 60 s GCS timeout: that path ends in "Failed to connect to GCS" and a C++ abort, checked above
    print(f"{took:.1f}s after the signal")
    deadline = time.time() + 30
    while _raylets(ray_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert not _raylets(ray_dir)


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of each process running (zombies have ended: left out)."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            table[int(pid)] = (int(fields[1]), int(fields[19]))
    return table


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process below `root` now (Ray's head processes, its agents and workers, the
    engine host): the start time tells one of them from a later process given the same pid."""
    table, found, todo = _process_table(), {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (ended)"


def _left_running(noted: dict[int, int], within_s: float) -> dict[int, int]:
    """Of `noted`, those still running after waiting up to `within_s` for them to end."""
    give_up = time.monotonic() + within_s
    while True:
        table = _process_table()
        left = {pid: start for pid, start in noted.items() if table.get(pid, (0, None))[1] == start}
        if not left or time.monotonic() > give_up:
            return left
        time.sleep(0.2)


@pytest.mark.slow
def test_nothing_the_run_started_outlives_a_killed_driver(tmp_path, ray_dir):
    """kill -9 of the driver mid-shards: within seconds no process it started runs, Ray's agents included (its
    dashboard and runtime env agents outlived the driver by a minute, trying to tell the dead GCS that their raylet
    was gone). A closed terminal's SIGHUP to the group: the SIGHUP test."""
    sweep = _run(tmp_path / "out", ray_dir)
    lines = _read_until(sweep, "mid-shards")
    noted = _descendants(sweep.pid)
    assert _raylets(ray_dir) & set(noted), ("no raylet of this run's Ray among its processes: nothing to check",
                                            sweep.poll(), "".join(lines)[-3000:])
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.communicate(timeout=120)
    left = _left_running(noted, within_s=15)  # a bound on a hang: the reaper ends them in about a second
    assert not left, [_command_line(pid)[:100] for pid in left]


@pytest.mark.slow
def test_a_lost_gcs_ends_the_run_in_one_line_within_seconds_and_the_run_resumes(tmp_path, ray_dir):
    """The run's own gcs_server killed once engines are up: one line saying the run's Ray head was lost, exit 1,
    in seconds (the sweep went on, then waited Ray's 60 s for the GCS and ended with Ray's C++ "Failed to connect
    to GCS" line), nothing of the run left running; the same command then resumes to every sample exactly once."""
    sweep = _run(tmp_path / "out", ray_dir)
    lines = _read_until(sweep, "engines up")
    noted = _descendants(sweep.pid)
    gcs = [pid for pid in noted if "/gcs/gcs_server " in _command_line(pid) and ray_dir in _command_line(pid)]
    assert len(gcs) == 1, ("not one GCS of this run's Ray among its processes", sweep.poll(), "".join(lines)[-3000:])
    os.kill(gcs[0], signal.SIGKILL)
    killed = time.monotonic()
    rest, _ = sweep.communicate(timeout=120)
    took = time.monotonic() - killed
    print(f"{took:.1f}s from the GCS's kill to the run's end")
    text = "".join(lines) + rest
    assert sweep.returncode == 1, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("[raysweep] stopped: this run's local Ray lost "
                                                                        f"its head (its gcs_server, pid {gcs[0]}, ")]
    assert len(stopped) == 1 and stopped[0].endswith(RESUMED_OR_DONE), text[-3000:]
    # our line, not Ray's: Ray's own wait for a lost GCS ends in its C++ "Failed to connect to GCS" line
    assert "Failed to connect to GCS" not in text and "Traceback" not in text, text[-3000:]
    assert not _left_running(noted, within_s=15), "a process of the run outlived it"
    again = _run(tmp_path / "out", ray_dir)
    text, _ = again.communicate(timeout=300)
    assert again.returncode == 0, text[-3000:]
    ids = pq.read_table(tmp_path / "out" / "results", columns=["task", "sample_id"]).to_pylist()
    assert len(ids) == len({(r["task"], r["sample_id"]) for r in ids}) == 250 + LEAN_EXTRACT_ROWS


def _code_spec(folder, sleep_s: float, timeout_s: float = 10, program: str | None = None):
    """A replay sweep of 20 programs through code_exec (no engine), each sleeping `sleep_s` (or `program`),
    shards of 5."""
    import json

    program = program or f"import time\ntime.sleep({sleep_s})\nassert True"
    (folder / "c.jsonl").write_text("".join(json.dumps({"id": str(i), "code": program}) + "\n" for i in range(20)))
    spec = folder / "s.yaml"
    spec.write_text(f"name: slow-code\noutput: {folder / 'out'}\nmodels: []\ntasks:\n"
                    "  - {name: slow, data: c.jsonl, id_column: id, prompt: '{id}', replay: {column: code},\n"
                    f"     scorer: {{name: code_exec, program: \"{{completion}}\\n\", timeout_s: {timeout_s}}}}}\n"
                    "shards: {max_samples: 5}\n")
    return spec


def _driver(spec, code: str = "", ray=None) -> subprocess.Popen:
    """`python -m jobs.sweep SPEC` in a process group of its own, after `code` (a test's hook) ran in it; on a local
    Ray of its own, or joined to the session's (`ray`, tests/conftest.py ray_local)."""
    script = f"{code}\nfrom jobs.sweep import exit_now, main\nexit_now(main([{str(spec)!r}]))"
    address = ray.get_runtime_context().gcs_address if ray is not None else ""
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1", "RAY_ADDRESS": address})


def _interrupted_at(sweep: subprocess.Popen, marker: str, delay_s: float = 0.0) -> str:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) once `marker` is printed; all it printed."""
    lines = []
    for line in sweep.stdout:
        lines.append(line)
        if marker in line:
            time.sleep(delay_s)
            os.killpg(sweep.pid, signal.SIGINT)
            break
    rest, _ = sweep.communicate(timeout=120)
    return "".join(lines) + rest


def _assert_one_stop_line(sweep: subprocess.Popen, text: str) -> str:
    assert sweep.returncode == 1, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("[raysweep] stopped by SIGINT: ")]
    assert len(stopped) == 1 and stopped[0].endswith("; the same command resumes the rest"), text[-3000:]
    assert "Traceback" not in text and "exception calling callback" not in text, text[-3000:]
    return stopped[0]


@pytest.mark.slow
def test_ctrl_c_during_code_exec_scoring_is_one_line_and_the_run_resumes(tmp_path, ray_local):
    """Ctrl-C while code_exec programs run: one line, not chained tracebacks (a CancelledError from each
    sandbox batch the closing pool cancelled). The interrupted run has a local Ray of its own; the resume joins
    the session's (a local Ray's start was most of its time; the resume of a run on its own local Ray is the
    signal tests' above)."""
    # 20 programs of 0.5 s, two at a time (the sandbox pool's threads on a 2-core machine): 5 s of programs at
    # least, so the Ctrl-C 1 s after they began finds most still to run; the resume runs the rest (1 s each took
    # twice as long for nothing more)
    spec = _code_spec(tmp_path, 0.5)
    sweep = _driver(spec)
    _assert_one_stop_line(sweep, _interrupted_at(sweep, "code_exec programs run sandboxed", delay_s=1.0))
    again = _driver(spec, ray=ray_local)
    text, _ = again.communicate(timeout=180)
    assert again.returncode == 0, text[-3000:]
    ids = pq.read_table(tmp_path / "out" / "results", columns=["sample_id"])["sample_id"].to_pylist()
    assert len(ids) == len(set(ids)) == 20


def _processes_naming(token: str) -> set[int]:
    """The processes whose command line holds `token` (zombies too: they are not reaped yet)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.add(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_ctrl_c_during_long_code_exec_programs_kills_them_and_ends_in_seconds(tmp_path):
    """Ctrl-C while code_exec programs sleep for 100 s (timeout_s 120): the line, and the process ended within
    seconds with no sandbox left, not once the programs' sleep was over (it waited for them)."""
    token = uuid.uuid4().hex  # in each program's command line, so that they can be found
    program = ("import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(100)', "
               f"{token!r}])")
    sweep = _driver(_code_spec(tmp_path, 0, timeout_s=120, program=program))
    lines = []
    for line in sweep.stdout:
        lines.append(line)
        if "code_exec programs run sandboxed" in line:
            break
    deadline = time.monotonic() + 60
    while not _processes_naming(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(token), "no program seen running: the check below would see none"
    os.killpg(sweep.pid, signal.SIGINT)
    signalled = time.monotonic()
    rest, _ = sweep.communicate(timeout=90)
    took = time.monotonic() - signalled
    print(f"{took:.1f}s from Ctrl-C to the process's end")
    _assert_one_stop_line(sweep, "".join(lines) + rest)  # within communicate's 90 s: below the programs' 100 s
    assert not _processes_naming(token)


@pytest.mark.slow
def test_ctrl_c_while_the_run_writes_its_end_lets_it_finish_and_says_all_is_committed(tmp_path, ray_local):
    """Ctrl-C while the run writes its telemetry and summary (a hook holds `finish` open 3 s): the run's end is written
    whole first (the summary, the run's record, the journal folded into manifest.json), then it stops: one line
    saying every shard is committed, exit 1. Before, the stop cut the end short: no summary, no run recorded, and a
    line saying the same command resumes the rest. The same command then runs nothing (joined to the session's
    local Ray, as the resume of the test above)."""
    from cluster.store.manifest import read_manifest

    spec = _code_spec(tmp_path, 0.0)
    hook = ("import time\nfrom cluster.store import sink\nfinish = sink.ResultSink.finish\n"
            "def held(self, *args, **kwargs):\n    print('[test] finishing', flush=True)\n    time.sleep(3)\n"
            "    return finish(self, *args, **kwargs)\nsink.ResultSink.finish = held")
    sweep = _driver(spec, hook)
    text = _interrupted_at(sweep, "[test] finishing")
    stopped = [line for line in text.splitlines() if line.startswith("[raysweep] stopped by SIGINT: ")]
    assert sweep.returncode == 1 and len(stopped) == 1 and "Traceback" not in text, text[-3000:]
    assert ": all 4 shard(s) of the sweep committed in " in stopped[0], stopped[0]
    assert stopped[0].endswith("; its summary is written as it stops"), stopped[0]
    assert pq.read_table(tmp_path / "out" / "summary.parquet").column("n").to_pylist() == [20]
    assert len(read_manifest(str(tmp_path / "out"))["runs"]) == 1 and not (tmp_path / "out" / "manifest.journal").exists()
    again = _driver(spec, ray=ray_local)
    text, _ = again.communicate(timeout=180)
    assert again.returncode == 0 and "(0 shards run, 4 already committed)" in text, text[-3000:]


def test_an_interrupt_that_ray_wait_returns_as_a_system_error_is_the_interrupt(monkeypatch, capfd):
    """Ctrl-C arriving inside ray.wait's C code came back as "SystemError: <cyfunction CoreWorker.wait> returned
    a result with an exception set", caused by our Interrupted: the run ended in a traceback (seen in the suite
    under load). It is the Interrupted: one line, exit 1."""
    import argparse

    from jobs import sweep
    from jobs.interrupts import Interrupted

    def wait_interrupted(*args, **kwargs):
        try:
            raise Interrupted(signal.SIGINT)
        except Interrupted as stop:  # as Cython leaves it: the SystemError raised while the Interrupted is set
            raise SystemError("<cyfunction CoreWorker.wait at 0x7f> returned a result with an exception set") from stop

    args = argparse.Namespace(spec="s.yaml", output=None, address=None, max_attempts=3, dashboard=False,
                              new_run=False, verbose=False)
    monkeypatch.setattr("jobs.lifecycle.SweepRun.read", wait_interrupted)  # the run's first step
    assert sweep.run_spec(None, args) == 1
    err = capfd.readouterr().err  # said with os.write, on the file descriptor
    assert err.startswith("[raysweep] stopped by SIGINT: ") and "Traceback" not in err and err.count("\n") == 1

    def other_system_error(*args, **kwargs):
        raise SystemError("not ours")

    monkeypatch.setattr("jobs.lifecycle.SweepRun.read", other_system_error)
    with pytest.raises(SystemError, match="not ours"):
        sweep.run_spec(None, args)


FINALIZED = """
import os, signal, time, weakref
from jobs.interrupts import Interrupted, interruptible

def slow():  # a finalizer the signal lands in (a staging folder's rmtree, in the run it was seen in)
    os.kill(os.getpid(), signal.SIGINT)
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        pass
    print("finalizer done", flush=True)

class Thing:
    pass

said = []
try:
    with interruptible(say=lambda stop: said.append(str(stop))):
        thing = Thing()
        weakref.finalize(thing, slow)
        del thing  # the finalizer runs here
        time.sleep(30)
    print("not interrupted")
except Interrupted as stop:
    print("interrupted by", stop, said)
"""


def test_a_signal_that_lands_in_a_finalizer_still_stops_the_run():
    """The first signal's Interrupted, raised inside a finalizer the garbage collector ran, was printed as
    "Exception ignored in: <finalize object>" with its traceback, and the run went on. It is taken again once the
    finalizer is done: the run stops, its line said once."""
    done = subprocess.run([sys.executable, "-c", FINALIZED], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["finalizer done", "interrupted by SIGINT ['SIGINT']"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_module_locks_weakref_callback_counts_as_a_finalizer():
    """A signal that lands in importlib's module-lock callback (`_get_module_lock.<locals>.cb`, run when a lock is
    freed) raised there is printed as "Exception ignored" and lost: the run went on to exit 0. The handler sees
    that frame as a finalizer and takes the signal again once out of it, as it does for __del__ and weakref's."""
    from types import SimpleNamespace

    from jobs.interrupts import _in_finalizer

    def frame(name, filename, back=None):
        return SimpleNamespace(f_code=SimpleNamespace(co_name=name, co_filename=filename), f_back=back)

    run = frame("run", "/x/jobs/sweep.py")
    assert _in_finalizer(frame("cb", "<frozen importlib._bootstrap>", run))
    assert _in_finalizer(frame("inner", "/x/a.py", frame("__del__", "/x/b.py", run)))
    assert not _in_finalizer(frame("cb", "/x/mine.py", run)) and not _in_finalizer(run)


FORKED = """
import multiprocessing, os, signal, time
from jobs.interrupts import interruptible

with interruptible(say=lambda stop: os.write(1, f"the command's stop line: {stop}\\n".encode())):
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))  # as lm-eval's pool's workers
    child.start()
    time.sleep(0.5)
    os.kill(child.pid, signal.SIGTERM)  # as the pool's terminate ends its workers
    child.join(30)
    print("child ended by", -child.exitcode if child.exitcode else child.exitcode, flush=True)
"""


def test_a_process_forked_by_the_run_ends_on_its_sigterm_without_the_runs_stop_line():
    """A process forked from the run (lm-eval's bootstrap pool) kept the run's stop handler: the pool's SIGTERM to
    its workers said the run's stop line in each, and a worker that then waited for a thread the fork did not copy
    kept the pool's join, and the sweep, waiting for ever (seen under load, once the shards were committed)."""
    done = subprocess.run([sys.executable, "-c", FORKED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == f"child ended by {int(signal.SIGTERM)}\n", done.stdout + done.stderr


SIGNALLED_IN_A_FORK = """
import os, signal, subprocess, sys


def signalled_in_the_child():  # a library's fork hook (filelock's), in the child between the fork and its program
    if os.getpid() != parent:
        os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C to the whole group, landing in the fork
        sum(range(1000))  # Python code after it: where a handler raises, if one does


parent = os.getpid()
if sys.argv[1] == "before":
    os.register_at_fork(after_in_child=signalled_in_the_child)  # before jobs's own hook
from jobs.interrupts import interruptible
if sys.argv[1] == "after":
    os.register_at_fork(after_in_child=signalled_in_the_child)

with interruptible(say=lambda stop: os.write(1, f"the command's stop line: {stop}\\n".encode())):
    child = subprocess.Popen([sys.executable, "-c", "print('the child ran its program')"], preexec_fn=lambda: None)
    print("child ended by", -child.wait(30), flush=True)  # Ray starts its processes this way (a preexec_fn)
"""


@pytest.mark.parametrize("hook", ["before", "after"])
def test_a_signal_in_a_process_forked_by_the_run_ends_it_without_a_word(hook):
    """A Ctrl-C as Ray started its processes landed in one between its fork and its program, inside a library's
    fork hook: Python's KeyboardInterrupt came out there as an "Exception ignored" traceback beside the run's one
    line. The child ends, silent, whether the signal comes before the run's handlers give way in it or after."""
    done = subprocess.run([sys.executable, "-c", SIGNALLED_IN_A_FORK, hook], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == f"child ended by {int(signal.SIGINT)}\n" and done.stderr == "", done.stdout + done.stderr


# a command's first moments (`python -m jobs.X`: sys.argv[0] is "-m" while its package imports): the SIGINT handler
# in place when the `signal` module's import begins, if anything imports it
FIRST_IMPORT = """
import _signal, sys

seen = []


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "signal":
            seen.append(getattr(_signal.getsignal(_signal.SIGINT), "__name__", "default"))
        return None


sys.meta_path.insert(0, Watch())
sys.argv = ["-m"]
import jobs
import signal
print(seen)
"""


def test_a_commands_own_signal_handlers_are_set_before_it_imports_anything():
    """A Ctrl-C 0.1 s after a command started, on a loaded machine, landed in `import signal` on the first lines of
    jobs/__init__.py, before its handlers were set: Python's KeyboardInterrupt traceback, not the one line. They are
    set through the interpreter's built-in `_signal`, before that import."""
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['_stopped_at_once']"]
