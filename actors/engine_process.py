"""An engine process: forked by the engine host (actors/engine_host.py) for one actor, it runs that actor's
engines (actors/engine_factory.py make_engine) and their shards (actors/shard_work.py run_rows), and answers
over the connection (the messages: cluster/contracts/engine_host.py). actors/hosted_engine.py is the actor's end.

- It takes the actor's environment (the GPUs Ray gave it, its CPU threads, test switches), its folder, and its
  stdout and stderr: what the engines print goes to the actor's log, as if they ran there.
- It is a session of its own, so its engines' processes (vLLM's engine core) are in its process group, and
  the terminal's Ctrl-C reaches only the driver.
- Calls run on threads of their own (shards stream into one engine, as in the actor); answers go back in the
  order they finish.
- When the actor's end of the connection closes (it closed its engines and went, or it was killed) the
  process group is killed: no engine outlives its actor holding GPU memory.
- When this process dies another way (an engine that broke exits it, as it would exit an actor), a watchdog
  kills the group too, vLLM's engine core included (forked outside Ray, it has no parent-death check of its
  own). The processes forked from this one do not keep the actor's connection open, so the actor sees it end.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from cluster.contracts.engine_host import CALL, EARLY, READY, RUN_ROWS, START

CALLS = ("sleep", "wake_up", "swap_weights", "close", "batch_counters")


def serve(client: socket.socket) -> None:
    """A connection the host took: an actor's (its engines run here until it goes) or the driver's asking for an
    early engine (built here now, for the actor that takes it)."""
    conn = Connection(client.detach())
    os.setsid()
    held = guard_group(conn.fileno())
    hello = conn.recv()
    if EARLY in hello:
        _serve_early(conn, hello, held)
        return
    _take_actor(conn, hello)
    Engines(conn).serve()


def _take_actor(conn: Connection, hello: dict, environment: bool = True) -> None:
    """The actor's stdout and stderr (sent after its hello), its environment (unless `environment` is False: an
    early engine keeps the one it was built under) and folder; then READY."""
    fds = [recv_handle(conn), recv_handle(conn)]
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # the host's were files (block-buffered); the actor's log is read live
        stream.reconfigure(line_buffering=True)
    if environment:
        _take_environment(hello["env"])
    try:
        os.chdir(hello["cwd"])
    except OSError:
        pass
    conn.send((READY, os.getpid()))


def _serve_early(driver: Connection, hello: dict, held: list[int]) -> None:
    """An early engine (cluster/contracts/engine_host.py): built now, under the driver's environment with the key's
    GPUs; the first actor that connects at its path (the socket the driver bound and sent after its message) takes it, and from then on this is that actor's engine
    process. Until then it ends when the driver's connection does (the driver let go of it, or is gone)."""
    from actors.engine_factory import engine_cpu_threads

    _take_environment(hello["env"])
    num_cpus, num_gpus, node_gpus = hello["threads"]
    if num_gpus and engine_cpu_threads(num_cpus, num_gpus, node_gpus) and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        os.chdir(hello["cwd"])
    except OSError:
        pass
    listener = socket.socket(fileno=recv_handle(driver))  # bound and listening since the driver asked
    held.append(listener.fileno())  # vLLM's engine core, forked while the engine builds, does not keep it
    engines = Engines(None)
    engines.build_early(hello["start"])
    taken = threading.Event()
    threading.Thread(target=_end_with_driver, args=(driver, taken), daemon=True, name="raysweep-early-driver").start()
    client, _ = listener.accept()
    taken.set()
    # no second actor comes here (one that comes later is forked a process of its own by the host); the listener
    # stays open, unreachable, so the number the forks let go of stays its own
    os.unlink(hello["path"])
    conn = Connection(client.detach())
    held.append(conn.fileno())
    # the environment stays the one the engine was built under (the driver's, with the actor's GPUs and threads,
    # and what vLLM's start set in it), which vLLM reads again as it runs
    _take_actor(conn, conn.recv(), environment=False)
    engines.conn = conn
    engines.serve()


def _end_with_driver(driver: Connection, taken: threading.Event) -> None:
    """The driver's connection read to its end: this process ends with it where no actor took the engine."""
    try:
        while True:
            driver.recv()
    except BaseException:  # noqa: BLE001  (its end: let go of, or gone)
        if not taken.is_set():
            end()


def guard_group(conn_fd: int) -> list[int]:
    """In a new process group's leader: a watchdog process that kills the group once this process is gone,
    however it went; and every process forked from this one from now on lets go of `conn_fd` (the connection
    it was forked for) and of the watchdog's pipe, so neither outlives this process in a child (vLLM's engine
    core). Returns the list of those descriptors: one added to it later (kept open) is let go of too."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the watchdog: holds only the pipe's read end
        os.close(write_end)
        os.close(conn_fd)
        while os.read(read_end, 1):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(0)
    os.close(read_end)
    held = [conn_fd, write_end]

    def let_go() -> None:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in held:
            os.dup2(devnull, fd)  # the number stays valid (objects that own it close it harmlessly)
        os.close(devnull)

    os.register_at_fork(after_in_child=let_go)
    return held


def _take_environment(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # CUDA starts with the engine, not at a check
    os.environ.setdefault("RAYSWEEP_VLLM_CORE", "fork")  # not a Ray actor: vLLM's own way outside Ray
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and "torch" in sys.modules:  # torch read the host's at import
        sys.modules["torch"].set_num_threads(int(threads))


class Engines:
    """The engines of one actor, by id, each with the tokenizer its shards' prompts are encoded with; and an
    early engine's build, which its actor's first start takes where it asks for the same engine."""

    def __init__(self, conn: Connection | None):
        self.conn = conn
        self.engines: dict[int, tuple] = {}
        self.ids = itertools.count()
        self.sending = threading.Lock()
        self.early: tuple[dict, Future] | None = None  # (start_engine's arguments, the engine once built)

    def build_early(self, start: dict) -> None:
        """Start building the engine of `start` (start_engine's arguments but the profile: the first start's, the
        default one) on a thread of its own."""
        from actors.engine import EngineProfile
        from actors.local_engine import InProcess

        kwargs = {**start, "profile": EngineProfile()}
        built: Future = Future()

        def build() -> None:
            try:
                built.set_result(InProcess().start_engine(**kwargs))
            except BaseException as e:  # noqa: BLE001  (the actor's start raises it as its own)
                built.set_exception(e)

        self.early = (kwargs, built)
        threading.Thread(target=build, daemon=True, name="raysweep-early-engine").start()

    def serve(self) -> None:
        while True:
            try:
                call_id, op, args = self.conn.recv()
            except BaseException:  # noqa: BLE001  (the actor is gone, or what it sent cannot be read: the end)
                end()
            threading.Thread(target=self._answer, args=(call_id, op, args), daemon=True,
                             name=f"raysweep-call-{call_id}").start()

    def _answer(self, call_id: int, op: str, args) -> None:
        try:
            answer = (call_id, True, self._do(op, args))
        except BaseException as e:  # noqa: BLE001  (the actor raises it as its own)
            answer = (call_id, False, _portable(e))
        try:
            with self.sending:
                self.conn.send(answer)
        except OSError:
            end()
        except Exception as e:  # noqa: BLE001  (an answer that does not pickle: the caller still gets one)
            try:
                with self.sending:
                    self.conn.send((call_id, False, RuntimeError(f"the engine's answer could not be sent: "
                                                                 f"{type(e).__name__}: {e}")))
            except Exception:  # noqa: BLE001
                end()

    def _do(self, op: str, args):
        if op == START:
            return self._start(args)
        if op == RUN_ROWS:
            engine_id, rows, task, add_special_tokens = args
            return self.engines[engine_id].run_rows(rows, task, add_special_tokens)
        if op == CALL:
            engine_id, method, *call_args = args
            if method not in CALLS:
                raise ValueError(f"engine call {method!r}: not one of {', '.join(CALLS)}")
            engine = self.engines[engine_id]
            value = getattr(engine, method)(*call_args)
            if method == "close":
                self.engines.pop(engine_id, None)
            return value
        raise ValueError(f"engine process: unknown call {op!r}")

    def _start(self, kwargs: dict) -> dict:
        from actors.local_engine import InProcess

        early, self.early = self.early, None
        engine = _taken(early, kwargs)
        where = "early" if engine is not None else "host"
        if engine is None:
            engine = InProcess().start_engine(**kwargs)
        engine_id = next(self.ids)
        self.engines[engine_id] = engine
        return {"id": engine_id, "kind": engine.kind, "profile": engine.profile, "startup": engine.startup(),
                "counters": hasattr(engine, "batch_counters"), "where": where}


def _taken(early: tuple[dict, Future] | None, kwargs: dict):
    """The early engine where it is the one asked for (waited for while it builds; its build's error raised as
    this start's), else None: one built for other arguments is closed first, so its GPU memory is free."""
    if early is None:
        return None
    wanted, built = early
    if wanted == kwargs:
        return built.result()
    try:
        built.result().close()
    except BaseException:  # noqa: BLE001  (an engine that failed to build holds nothing)
        pass
    return None


def _portable(e: BaseException) -> BaseException:
    """The exception itself where it pickles, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def end() -> None:
    """The actor is gone (or this process ends): this process and its engines' processes go too."""
    os.killpg(os.getpgrp(), signal.SIGKILL)
