"""A sandbox for untrusted, model-generated Python programs (the `code_exec` scorer runs them here).

Each program runs in a process of its own, under the driver's interpreter with the standard library only
(`-I -S`: no site-packages, no PYTHON* variables), in a fresh empty directory gone afterwards, with a
minimal environment (PATH, HOME, LANG), limits on wall clock, CPU time, address space, processes (a fork
bomb stops at `max_processes`), bytes written and output kept, and oom_score_adj 1000, so that under
memory pressure the kernel's OOM killer takes a sandbox before the driver.

Which plan applies is measured once by a probe program: `check_available()` says it in one line, or raises
SandboxError naming why none applies. The plans, strongest first, and what each protects against:
- bubblewrap (`bwrap` >= 0.8, Debian package `bubblewrap`), the driver root or not: new mount, pid,
  network, ipc, uts and user namespaces; the program sees /usr, the interpreter's prefix and a few /etc
  files read-only, a private /proc and /dev, and a tmpfs /tmp of `disk_mb` as its directory; as uid 65534
  where the driver is root (rlimits do not bind root). It cannot read the driver's environment or any file
  beyond those binds, write outside its tmpfs, open a network connection, or see or signal a process
  outside its pid namespace, which dies with it.
- root without bubblewrap: the program runs as uid 65534, in new network, ipc, uts and user namespaces
  where the kernel allows, with sockets blocked inside Python. It cannot signal the driver or read what
  only root can read, but it shares the pid namespace and uid 65534 with every other sandbox: it can kill
  a neighbour's program (recorded as killed by a signal) or any uid-65534 process on the host. It can also
  read world-readable files, write to world-writable directories (/tmp, /dev/shm), use host Unix sockets,
  reach the network through ctypes or a subprocess where no network namespace could be made, and leave
  behind a process that called setsid.
- not root without bubblewrap: refused. The program would keep the driver's own uid (it only shows as
  65534 inside a user namespace): it could read and change every file the driver can and kill the driver.
  Only a task with `unsafe_fallback: true` runs so.
No plan protects against kernel exploits (no seccomp filter; the kernel is shared; with bwrap run as root
the program may create nested user namespaces), timing and cache side channels, CPU and memory-bandwidth
starvation of neighbours within the limits, memory summed over processes (no cgroup: `memory_mb` binds
each process, so up to `max_processes` x `memory_mb` in all), or a program that lies (`os._exit(0)` before
its asserts passes).

How a program ended is what the bootstrap reports on a pipe (its exit code, or the exception it raised), so
`sys.exit(137)` is a failure with exit code 137, not a kill. Only a program that leaves by `os._exit` is
read from the exit status alone, where under bubblewrap a code above 128 reads as a signal (bwrap's 128 + N).
A program whose sandbox fails to start (SandboxError, or an OSError such as EAGAIN from fork) is tried
again, then recorded as an `error` with `started` False; a batch fails only when none of it started.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache

NOBODY = 65534  # the unprivileged uid programs run as when the driver is root
ERROR_EXIT = 70  # the bootstrap's exit when the program raised something other than AssertionError
_NEWUSER, _NEWNET, _NEWIPC, _NEWUTS = 0x10000000, 0x40000000, 0x08000000, 0x04000000
_NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts")
_SYSTEM = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # symlinks into /usr on merged-/usr
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")  # for ld.so and time

# Runs first in the sandbox: raise oom_score_adj, isolate further, drop to the uid, read the program from
# stdin, set the limits, report "ready" on status_fd (a sandbox that never started is thus told apart from a
# failing program), run the program as __main__ in this same process, and report how it ended ("exit N",
# "raised assert", "raised error"): a program's own exit code is thus told apart from a signal.
BOOTSTRAP = r"""
import json, os, sys
cfg, me = json.loads(sys.argv[1]), os.getpid()
try:  # raising one's own oom_score_adj needs no privilege; children inherit it
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
except OSError:
    pass

def report(what):
    if os.getpid() == me:  # not a forked child of the program, whose SystemExit comes through here too
        try:
            os.write(cfg["status_fd"], what.encode() + b"\n")
        except OSError:  # the program closed it: its exit status alone tells
            pass

def unshare(flags):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if flags and libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare(%#x) failed" % flags)

unshare(cfg["early"])
if cfg["uid"] is not None:
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
unshare(cfg["late"])
source = sys.stdin.buffer.read()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
if cfg["block_sockets"]:
    import socket, _socket
    def no_network(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    class NoSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            no_network()
    socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = NoSocket
    for module in (socket, _socket):
        for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "create_connection",
                     "create_server", "socketpair", "fromfd"):
            if hasattr(module, name):
                setattr(module, name, no_network)
import resource
for name, soft, hard in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.set_inheritable(cfg["status_fd"], False)  # a program's exec'd subprocess does not hold it open
report("ready")
import linecache, traceback, types
linecache.cache["program.py"] = (len(source), None, source.decode("utf-8", "replace").splitlines(True),
                                 "program.py")  # so tracebacks show the program's lines
main = types.ModuleType("__main__")
sys.modules["__main__"], sys.argv = main, ["program.py"]
sys.path.insert(0, os.getcwd())
try:
    exec(compile(source, "program.py", "exec"), main.__dict__)
except SystemExit as exc:
    code = exc.code  # as the interpreter will exit: None 0, an int its low byte, anything else 1
    report("exit %d" % (0 if code is None else code & 0xFF if isinstance(code, int) else 1))
    raise
except BaseException as exc:
    report("raised assert" if isinstance(exc, AssertionError) else "raised error")
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1 if isinstance(exc, AssertionError) else ERROR_EXIT)
report("exit 0")
""".replace("ERROR_EXIT", str(ERROR_EXIT))


class SandboxError(RuntimeError):
    """The sandbox itself failed, not the program: no isolation works here, or a run did not start."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0      # wall clock from start to kill
    cpu_s: float | None = None   # CPU time of each process (RLIMIT_CPU, whole seconds up); None: timeout_s
    memory_mb: int = 1024        # address space of each process (RLIMIT_AS)
    max_processes: int = 32      # processes and threads of the program together (RLIMIT_NPROC)
    output_bytes: int = 65536    # output kept: the head of stdout and the tail of stderr, half each
    disk_mb: int = 64            # bytes it may write: its tmpfs (bwrap) and each file (RLIMIT_FSIZE)

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s"):
            value = getattr(self, name)
            if not (value is None and name == "cpu_s") and not (
                    isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        # memory_mb >= 64: below that the interpreter cannot start under RLIMIT_AS
        for name, low in (("memory_mb", 64), ("max_processes", 1), ("output_bytes", 2), ("disk_mb", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def rlimits(self) -> list[tuple[str, int, int]]:
        """(resource, soft, hard), soft = hard so the program cannot raise them; CPU: SIGXCPU at the soft
        limit, SIGKILL a second later should the program ignore it."""
        cpu = math.ceil(self.timeout_s if self.cpu_s is None else self.cpu_s)
        memory, disk = self.memory_mb << 20, self.disk_mb << 20
        return [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory, memory), ("RLIMIT_CORE", 0, 0),
                ("RLIMIT_NPROC", self.max_processes, self.max_processes), ("RLIMIT_FSIZE", disk, disk)]


@dataclass
class Outcome:
    status: str            # passed | failed (AssertionError, non-zero exit) | timeout | error (raised else,
                           # killed, or its sandbox never started)
    error: str | None      # last non-empty stderr line, or why (timed out, killed by signal N); None if passed
    exit_code: int | None  # the program's exit status; -N when killed by signal N; None when timed out
    wall_s: float
    stdout: str = ""
    stderr: str = ""
    started: bool = True   # False: its sandbox never started, on any try (status error); nothing of it ran


@dataclass(frozen=True)
class _Plan:
    """One way to isolate; `_plan()` takes the first under which a probe program runs as expected."""
    label: str
    bwrap: str | None       # "user": bwrap makes a user namespace; "root": bwrap runs as root; None: no bwrap
    popen_user: int | None  # uid to drop to before exec (bwrap then runs unprivileged)
    boot_uid: int | None    # uid the bootstrap, started as root, drops to
    early: int              # unshare flags before that drop (all but a user namespace need root)
    late: int               # unshare flags after it
    block_sockets: bool
    expect: frozenset[str]  # namespaces the probe must find new
    new: tuple[str, ...] = ()  # namespaces the probe found new
    as_driver: bool = False    # the program keeps the driver's own uid: only with unsafe_fallback

    def nobody_reads_python(self) -> bool:
        """Whether uid 65534 must reach the interpreter's install on the host (not through a root bwrap's bind)."""
        return self.popen_user == NOBODY or (self.bwrap is None and self.boot_uid == NOBODY)


def run_program(source: str, limits: SandboxLimits = SandboxLimits(), unsafe_fallback: bool = False) -> Outcome:
    """Run one program in a fresh sandbox; SandboxError (or OSError) only for the sandbox's own failures.
    `unsafe_fallback`: a driver that is not root may run it under its own uid where bubblewrap fails."""
    return _run(_plan(_unsafe(unsafe_fallback)), source, limits)


def check_available(unsafe_fallback: bool = False) -> str:
    """The isolation that applies on this machine, in one line, as a probe program found it; else SandboxError,
    one line naming the cause. Probes once per process and flag (a failure is probed again on the next
    call), so preflight can call it before Ray starts and the pool's first use finds the answer ready."""
    plan = _plan(_unsafe(unsafe_fallback))
    files = ("read-only /usr and Python, a tmpfs /tmp as its directory" if plan.bwrap else
             "a fresh directory, file permissions only")
    net = ("a new namespace" if "net" in plan.new else "shared") + (
        ", sockets blocked inside Python" if plan.block_sockets else "")
    return (f"{plan.label}; new namespaces: {', '.join(plan.new) or 'none'}; files: {files}; network: {net}; "
            f"rlimits on CPU, memory, processes, file size")


def _unsafe(unsafe_fallback: bool) -> bool:
    """The flag as it matters: root never runs a program under its own uid, so it ignores it (one probe)."""
    return bool(unsafe_fallback) and os.geteuid() != 0


RETRY_PAUSES_S = (0.2, 1.0)  # before each new try of a program whose sandbox failed to start (EAGAIN passes)


class SandboxPool:
    """Runs many programs concurrently on this node, off the caller's thread: one thread per running sandbox."""

    def __init__(self, workers: int | None = None):
        workers = (os.cpu_count() or 1) if workers is None else workers
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

    def submit(self, programs: list[str], limits: SandboxLimits, unsafe_fallback: bool = False
               ) -> concurrent.futures.Future:
        """A future of the programs' Outcomes in order. A program whose sandbox fails to start is tried again,
        then its Outcome is an `error` with `started` False; the future fails (SandboxError) only where no
        program started, or on a fault of this code, and then cancels the rest."""
        check_available(unsafe_fallback)  # no sandbox here: SandboxError now, not once per program
        result: concurrent.futures.Future = concurrent.futures.Future()
        parts = [self._threads.submit(_tries, p, limits, unsafe_fallback) for p in programs]
        left, lock = [len(parts)], threading.Lock()

        def part_done(part: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if result.done():  # failed by another part, or cancelled by the caller
                return
            if not part.cancelled() and part.exception() is not None:
                _settle(result, exception=part.exception())
            elif last:
                outcomes = [p.result() for p in parts]
                if any(o.started for o in outcomes):
                    _settle(result, value=outcomes)
                else:  # the sandbox is broken, not one program's start unlucky
                    _settle(result, exception=SandboxError(f"no program of {len(parts)} started: {outcomes[0].error}"))

        def result_done(_: concurrent.futures.Future) -> None:
            for part in parts:  # failed or cancelled: the programs not started yet are dropped
                part.cancel()

        result.add_done_callback(result_done)
        if not parts:
            result.set_result([])
        for part in parts:
            part.add_done_callback(part_done)
        return result

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tries(source: str, limits: SandboxLimits, unsafe_fallback: bool) -> Outcome:
    """run_program, tried again after each of RETRY_PAUSES_S where its sandbox failed to start; after the last
    try an `error` Outcome saying why, with `started` False."""
    start = time.perf_counter()
    for pause in (*RETRY_PAUSES_S, None):
        try:
            return run_program(source, limits, unsafe_fallback)
        except (SandboxError, OSError) as e:
            if pause is None:
                why = str(e) if isinstance(e, SandboxError) else f"{type(e).__name__}: {e}"
                return Outcome("error", f"the sandbox failed on each of {len(RETRY_PAUSES_S) + 1} tries: {why}",
                               None, time.perf_counter() - start, started=False)
            time.sleep(pause)


def _settle(result: concurrent.futures.Future, value=None, exception=None) -> None:
    try:
        result.set_exception(exception) if exception is not None else result.set_result(value)
    except concurrent.futures.InvalidStateError:  # cancelled by the caller, or failed by another part
        pass


def _candidates() -> list[_Plan]:
    """Strongest first. As root the program must still run as an unprivileged uid: RLIMIT_NPROC does not
    bind uid 0, so a fork bomb would not stop. Not as root, only bubblewrap keeps a program away from the
    driver; the fallbacks (`as_driver`) run it under the driver's own uid."""
    every, some = frozenset(_NAMESPACES), frozenset({"user", "net", "ipc", "uts"})
    if os.geteuid() != 0:
        unsafe = ("UNSAFE fallback without bubblewrap (unsafe_fallback): programs run as the driver's uid "
                  f"{os.geteuid()}")
        return [_Plan("bubblewrap", "user", None, None, 0, 0, False, every),
                _Plan(unsafe, None, None, None, _NEWUSER | _NEWNET | _NEWIPC | _NEWUTS, 0, True, some, as_driver=True),
                _Plan(f"{unsafe}; the process limit counts all of this user's processes", None, None, None, 0, 0,
                      True, frozenset(), as_driver=True)]
    return [_Plan("bubblewrap, run as uid 65534", "user", NOBODY, None, 0, 0, False, every),
            # bwrap as root can bind an interpreter that uid 65534 cannot reach (under /root, say)
            _Plan("bubblewrap run as root, the program as uid 65534 in a user namespace of its own", "root",
                  None, NOBODY, 0, _NEWUSER, False, every),
            _Plan("fallback without bubblewrap, as uid 65534 (no pid namespace: it can signal other uid-65534 "
                  "processes)", None, None, NOBODY, _NEWNET | _NEWIPC | _NEWUTS, _NEWUSER, True, some),
            _Plan("fallback without bubblewrap, as uid 65534 (no pid namespace: it can signal other uid-65534 "
                  "processes); the process limit counts all its processes on this machine", None, None, NOBODY,
                  0, 0, True, frozenset())]


# imports decimal: a module first imported after the uid drop must still load
_PROBE = ("import decimal, json, os\n"
          f"ns = {{n: os.readlink('/proc/self/ns/' + n) for n in {_NAMESPACES!r}}}\n"
          "print(json.dumps({'uid': os.getuid(), **ns}))")


@lru_cache(maxsize=2)
def _plan(unsafe_fallback: bool) -> _Plan:
    """The first candidate under which the probe program runs and finds the namespaces it expects."""
    has_bwrap = shutil.which("bwrap") is not None
    why = [] if has_bwrap else ["bwrap is not installed (apt-get install -y bubblewrap)"]
    hidden = _hidden_from_nobody()
    mine = {n: os.readlink(f"/proc/self/ns/{n}") for n in _NAMESPACES}
    for plan in _candidates():
        if (plan.bwrap and not has_bwrap) or (plan.as_driver and not unsafe_fallback):
            continue
        try:
            out = _run(plan, _PROBE, SandboxLimits(timeout_s=30))
        except (SandboxError, OSError) as e:
            reason = hidden if hidden and plan.nobody_reads_python() else str(e)
            why += [] if reason in why else [reason]
            continue
        if out.status != "passed":
            why.append(f"{plan.label}: the probe {out.status}: {out.error}")
            continue
        theirs = json.loads(out.stdout)
        new = tuple(n for n in _NAMESPACES if theirs[n] != mine[n])
        if not plan.expect <= set(new) or theirs["uid"] == 0:
            why.append(f"{plan.label}: the probe ran as uid {theirs['uid']} in new namespaces {new}, "
                       f"expected a non-zero uid and {sorted(plan.expect)}")
            continue
        label = plan.label.replace("bubblewrap", f"bubblewrap {_bwrap_version()}", 1) if plan.bwrap else plan.label
        return replace(plan, label=label + (f" ({'; '.join(why)})" if why else ""), new=new)
    if os.geteuid() != 0 and not unsafe_fallback:
        raise SandboxError(
            f"code_exec needs bubblewrap when the driver is not root, and "
            f"{'it fails here: ' + '; '.join(why) if has_bwrap else 'bwrap is not installed'}: install "
            f"bubblewrap 0.8 or later (apt-get install -y bubblewrap), or set `unsafe_fallback: true` in the "
            f"task's code_exec scorer to run programs as this driver's uid {os.geteuid()}, able to read and "
            f"change its files and to kill it")
    raise SandboxError("no sandbox works on this machine: " + "; ".join(why))


def _hidden_from_nobody() -> str | None:
    """Why uid 65534 cannot reach the interpreter's install (a directory on the way it may not search, or
    the install it may not list), or None; file modes only, so a diagnosis rather than a verdict."""
    for root in _python(every=True)[1]:
        for path in (*_ancestors(root), root):
            try:
                st = os.stat(path)
            except OSError:
                return None
            bits = st.st_mode >> (6 if st.st_uid == NOBODY else 3 if st.st_gid == NOBODY else 0)
            need = 0o5 if path == root else 0o1
            if bits & need != need:
                return (f"uid {NOBODY} cannot reach the Python install {root}: {path} is mode "
                        f"{st.st_mode & 0o777:04o}")
    return None


def _bwrap_version() -> str:
    out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.split()[-1] if out.returncode == 0 and out.stdout.split() else "(version unknown)"


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


def _run(plan: _Plan, source: str, limits: SandboxLimits) -> Outcome:
    """1. write the source to an unlinked file, the bootstrap's stdin; 2. start the sandbox; 3. read its
    output until it exits or the wall clock runs out; 4. kill what is left; 5. say how it ended."""
    workdir = None if plan.bwrap else tempfile.mkdtemp(prefix="raysweep-sandbox-")
    pipes = {"status": os.pipe(), **({"info": os.pipe()} if plan.bwrap else {})}
    unclosed = {fd for pair in pipes.values() for fd in pair}
    start = time.perf_counter()
    try:
        with tempfile.TemporaryFile() as stdin:
            stdin.write(source.encode("utf-8", "surrogateescape"))
            stdin.seek(0)
            proc = _start(plan, limits, stdin, workdir, {name: w for name, (_, w) in pipes.items()})
        for _, w in pipes.values():
            os.close(w)
            unclosed.discard(w)
        got = _collect(proc, {name: r for name, (r, _) in pipes.items()}, start + limits.timeout_s,
                       limits.output_bytes // 2)
        timed_out = not _exited(proc.pid)
        _stop(proc, got.get("info", b""), timed_out)
        code = proc.wait()
    finally:
        for fd in unclosed:
            os.close(fd)
        if workdir:
            shutil.rmtree(workdir, onerror=functools.partial(_writable_then_retry, workdir))
    wall = time.perf_counter() - start
    stdout, stderr = got["out"].decode("utf-8", "replace"), got["err"].decode("utf-8", "replace")
    status = got["status"].decode("ascii", "replace").splitlines()
    if status[:1] != ["ready"] and not timed_out:
        raise SandboxError(f"{plan.label}: the sandbox did not start: exit {code}: {_last_line(stderr)}")
    ends = [line for line in status[1:] if line in ("raised assert", "raised error") or
            (line[:5] == "exit " and line[5:].isdigit() and len(line) <= 8)]
    return _classify(plan, code, ends[-1] if ends else None, timed_out, limits, wall, stdout, stderr)


def _start(plan: _Plan, limits: SandboxLimits, stdin, workdir: str | None, fds: dict[str, int]) -> subprocess.Popen:
    config = {"early": plan.early, "late": plan.late, "uid": plan.boot_uid, "status_fd": fds["status"],
              "rlimits": limits.rlimits(), "block_sockets": plan.block_sockets}
    argv = [_python()[0], "-I", "-S", "-B", "-c", BOOTSTRAP, json.dumps(config)]
    if plan.bwrap:
        argv = _bwrap_argv(plan, limits, fds["info"]) + argv
    elif plan.boot_uid is not None:
        os.chown(workdir, plan.boot_uid, plan.boot_uid)
    # none of the driver's environment: HOME is the program's own directory
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir or "/tmp", "LANG": "C.UTF-8"}
    # start_new_session: one killpg reaches what the program forked where there is no pid namespace
    return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=workdir or "/", pass_fds=tuple(fds.values()), start_new_session=True,
                            user=plan.popen_user, group=plan.popen_user,
                            extra_groups=None if plan.popen_user is None else [])


def _collect(proc: subprocess.Popen, fds: dict[str, int], deadline: float, cap: int) -> dict[str, bytes]:
    """Read until every pipe closes or the deadline, then await the exit. The head of stdout and the tail
    of stderr (where the error line is) are kept; the rest is drained so the program never blocks."""
    got = {"out": bytearray(), "err": bytearray(), **{name: bytearray() for name in fds}}
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
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _classify(plan: _Plan, code: int, ended: str | None, timed_out: bool, limits: SandboxLimits, wall: float,
              stdout: str, stderr: str) -> Outcome:
    """`ended`: how the bootstrap saw the program end ("exit N", "raised assert|error"), None where it never
    said (killed by a signal, or left by os._exit): then the exit status alone tells."""
    def outcome(status: str, error: str | None, exit_code: int | None) -> Outcome:
        return Outcome(status, error, exit_code, wall, stdout, stderr)

    if timed_out:
        return outcome("timeout", f"timed out after {limits.timeout_s:g} s", None)
    if ended is not None:  # the program's word wins over a status an atexit os._exit or a late signal changed
        code = int(ended.split()[1]) if ended.startswith("exit ") else 1 if ended == "raised assert" else ERROR_EXIT
    elif plan.bwrap and code > 128:  # bwrap reports its child's death by signal N as exit 128 + N
        code = 128 - code
    if code == 0:
        return outcome("passed", None, 0)
    if code == -signal.SIGXCPU:
        cpu = limits.timeout_s if limits.cpu_s is None else limits.cpu_s
        return outcome("timeout", f"CPU time limit of {cpu:g} s exceeded", code)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "unknown"
        return outcome("error", f"killed by signal {-code} ({name})", code)
    if ended == "raised error" or (ended is None and code == ERROR_EXIT):
        return outcome("error", _last_line(stderr) or "raised an exception", code)
    return outcome("failed", _last_line(stderr) or f"exit code {code}", code)


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


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
