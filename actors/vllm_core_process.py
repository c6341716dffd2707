"""Where vLLM's engine core runs, and how its start-up report is read back.

vLLM runs its engine core (scheduler, model, KV cache) in a process of its own. Outside Ray it forks that
process from the one that built `LLM(...)`, which has vLLM imported already. Inside a Ray actor vLLM
spawns it instead (a fork would copy the locks of a Ray worker's threads), and a spawned process imports
torch and vLLM all over again: 18 s between `LLM(...)` and the engine core's first line on an H100
machine, on every engine start, after the actor's own import of vLLM (bench/records/h100-whole-process-forkserver.md).

`RAYSWEEP_VLLM_CORE` chooses:
- `forkserver` (the default): when the actor starts, a forkserver (Python's multiprocessing) starts with
  it: a new single-threaded process that imports vLLM's engine core while the actor imports the rest.
  Every engine start then forks its engine core from there, imported, as vLLM does outside Ray. vLLM 0.26
  has no setting for it (VLLM_WORKER_MULTIPROC_METHOD takes spawn or fork), so the process context of
  its engine-core launcher, `vllm.v1.engine.utils.get_mp_context`, is wrapped: vLLM's own checks still
  run, only the start method changes. A vLLM without that function gets `spawn`, and telemetry says so.
- `fork`: vLLM's own choice outside Ray: the engine core forked from the process that builds the engine. An
  engine process forked from a local run's engine host (actors/engine_host.py) is not a Ray actor, has vLLM
  imported already, and runs this mode unless the environment names another.
- `spawn`: vLLM's own choice inside an actor.
- `inprocess`: the engine core in the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0). No second
  process at all, but the engine core's scheduling then shares the actor's GIL with output processing:
  generation ran at half the speed on an H100 (bench/records/h100-whole-process-in-actor-engine-core.md).

A forked core inherits the forkserver's environment, fixed when the forkserver starts: what the engine
core reads from the environment (VLLM_LOGGING_LEVEL=INFO for its start-up report, CUDA_VISIBLE_DEVICES
from Ray) is set before `start()`.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import time
import uuid

from actors.vllm_args import ENGINE_ENV

MODES = ("forkserver", "fork", "spawn", "inprocess")
CORE_MODULE = "vllm.v1.engine.core"  # what the forkserver imports: EngineCoreProc and all it needs
_state: dict = {"mode": None}  # the mode this process runs, once start() chose it; its environment


def requested_mode() -> str:
    mode = os.environ.get("RAYSWEEP_VLLM_CORE", "forkserver")
    if mode not in MODES:
        raise ValueError(f"RAYSWEEP_VLLM_CORE={mode!r}: use one of {', '.join(MODES)}")
    return mode


def start() -> str:
    """Once per process, before vLLM is imported: vLLM's process settings, the output tee, and (mode
    `forkserver`) the forkserver with its import under way. Returns the mode that engine starts will use."""
    if _state["mode"] is not None:
        return _state["mode"]
    mode = requested_mode()
    for name, value in ENGINE_ENV.items():  # actors/vllm_args.py says why; read by vLLM's workers
        os.environ.setdefault(name, value)
    # a process that has touched CUDA cannot fork a working engine core, and vLLM forces spawn in Ray
    # actors itself: spawn is the method vLLM is told, whatever the forkserver then does instead; outside
    # Ray (`fork`) vLLM forks, and still spawns where CUDA was touched first
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork" if mode == "fork" else "spawn"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "inprocess" else "1"
    OutputTee.install()  # before the forkserver: its children write to the fds it inherits
    if mode == "forkserver":
        level = os.environ.get("VLLM_LOGGING_LEVEL")
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"  # the start-up report (compile, graphs) is logged at INFO
        # vLLM names a shared-memory buffer per process tree on first use (multimodal caches), in the
        # environment: named now, the actor and every core forked later agree on it
        os.environ.setdefault("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME",
                              f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{uuid.uuid4().hex}")
        try:
            multiprocessing.set_forkserver_preload([CORE_MODULE])
            from multiprocessing import forkserver

            forkserver.ensure_running()  # returns at once; the server imports while this process goes on
            _state["env"] = _vllm_env()  # what a forked engine core will see
        finally:
            restore_env("VLLM_LOGGING_LEVEL", level)
    _state["mode"] = mode
    return mode


def use_for_engine_core() -> str:
    """Called with vLLM imported, before `LLM(...)`: point vLLM's engine-core launcher at the forkserver.
    Returns the mode that this engine start really uses (`spawned` where the hook is missing)."""
    mode = start()
    if mode == "inprocess":
        return "in-process"
    if mode == "fork":
        _state["used"] = "forked"
        return "forked"
    import vllm.v1.engine.utils as launcher

    original = getattr(launcher, "get_mp_context", None)
    if mode != "forkserver" or original is None:
        return "spawned"
    if not getattr(original, "_raysweep_forkserver", False):
        def get_mp_context():
            spawn = original()  # vLLM's checks, and the environment it sets for its children
            reason = _forkserver_unfit()
            if reason:
                print(f"[raysweep] engine core spawned, not forked: {reason}", file=sys.stderr)
                _state["used"] = "spawned"
                return spawn
            _state["used"] = "forkserver"
            return EngineCoreContext()

        get_mp_context._raysweep_forkserver = True
        launcher.get_mp_context = get_mp_context
    _state["used"] = "forkserver"
    return "forkserver"


def used_mode() -> str | None:
    """What the last engine start used: `forkserver` or `forked`, or `spawned` where neither fit (vLLM
    forces spawn on a process that touched CUDA, and says so in VLLM_WORKER_MULTIPROC_METHOD)."""
    if _state.get("used") == "forked" and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
        return "spawned"
    return _state.get("used")


def _vllm_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k != "VLLM_LOGGING_LEVEL"}


def _forkserver_unfit() -> str | None:
    """Why this engine start cannot fork from the forkserver, or None. A forked core sees the environment
    of the forkserver's start: a vLLM setting made since (vLLM sets some for its children, by model
    architecture) needs a spawned core; and a forkserver that died (its import crashed) forks nothing."""
    from multiprocessing import forkserver

    now, then = _vllm_env(), _state.get("env", {})
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    if changed:
        return f"{', '.join(changed)} changed since the forkserver started"
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # noqa: SLF001
    try:
        if pid is None or os.waitpid(pid, os.WNOHANG) != (0, 0):
            return "the forkserver is not running"
    except ChildProcessError:
        return "the forkserver is not running"
    return None


def die_with_parent(parent_pid: int | None) -> None:
    """In a forked engine core: be killed when the forkserver goes, which it does when its actor does
    (killed, or gone with os._exit), so no engine core outlives its actor holding GPU memory. Ray kills an
    actor's own children; the engine core is the forkserver's. Linux's PR_SET_PDEATHSIG; elsewhere none.
    A forkserver already gone by then is seen by the parent id having changed."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


class EngineCoreProcess(multiprocessing.context.ForkServerProcess):
    def start(self) -> None:
        from multiprocessing import forkserver

        forkserver.ensure_running()
        self._forkserver_pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # noqa: SLF001
        super().start()

    def run(self) -> None:
        die_with_parent(getattr(self, "_forkserver_pid", None))
        super().run()


class EngineCoreContext(multiprocessing.context.ForkServerContext):
    """The forkserver's context, whose processes die with the forkserver."""
    Process = EngineCoreProcess


def restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class OutputTee:
    """Routes this process's stdout and stderr (fds 1 and 2, inherited by vLLM's engine-core process and by
    the forkserver) through a pipe whose reader copies everything to the original stderr and keeps the
    last MiB, so vLLM's start-up reports (graph capture, compile time) can be read back. Once per process."""

    _installed: "OutputTee | None" = None
    KEEP = 1 << 20

    @classmethod
    def install(cls) -> "OutputTee":
        if cls._installed is None:
            cls._installed = cls()
        return cls._installed

    def __init__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._out = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd = read_fd
        self._buffer = bytearray()
        self._dropped = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, args=(read_fd,), name="raysweep-tee", daemon=True).start()
        # the pump is a daemon thread: at the interpreter's exit, lines written just before (the engine's last
        # words) were lost where the pump had not run yet (seen on a loaded machine); they go out first
        atexit.register(self.drain)

    def _pump(self, fd: int) -> None:
        while chunk := os.read(fd, 65536):
            os.write(self._out, chunk)
            with self._lock:
                self._buffer += chunk
                if len(self._buffer) > self.KEEP:
                    cut = len(self._buffer) - self.KEEP
                    del self._buffer[:cut]
                    self._dropped += cut

    def drain(self, timeout_s: float = 2.0) -> None:
        """Wait until what was written so far has reached the original stderr (before os._exit, say)."""
        import fcntl
        import struct
        import termios

        sys.stdout.flush()
        sys.stderr.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pending = struct.unpack("i", fcntl.ioctl(self._read_fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            if not pending:
                break
            time.sleep(0.01)
        time.sleep(0.05)  # the pump's last chunk, read but maybe not yet written

    def mark(self) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        with self._lock:
            return self._dropped + len(self._buffer)

    def text_since(self, mark: int) -> str:
        self.drain()  # what the engine core wrote last, read by the pump (a fixed pause missed it on a busy machine)
        with self._lock:
            start = max(0, mark - self._dropped)
            return bytes(self._buffer[start:]).decode("utf-8", errors="replace")
