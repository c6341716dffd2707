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
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from cluster.contracts.engine_host import CALL, READY, RUN_ROWS, START, Prestart

CALLS = ("sleep", "wake_up", "close", "batch_counters")


def serve(conn: Connection, hello: dict) -> None:
    """Serve the actor that sent `hello` on `conn` (the host read it), from a new process group."""
    os.setsid()
    guard_group([conn.fileno()])
    _take_output(conn)
    _take_environment(hello["env"])
    _enter(hello["cwd"])
    conn.send((READY, os.getpid()))
    Engines(conn).serve()


def prestarted(link: socket.socket, ahead: Prestart) -> None:
    """An engine started before its actor exists (cluster/contracts/engine_host.py PRESTART): it starts at once
    on the actor's GPUs, with the actor's threads, while this process waits on `link` for the host to hand it
    an actor's connection (SCM_RIGHTS) and hello. Then it serves that actor as any engine process; its first
    start takes the engine if it asked for this one. Until claimed it dies with the host."""
    os.setsid()
    guarded = [link.fileno()]
    guard_group(guarded)
    _die_with_parent()
    if ahead.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ahead.gpus
    _set_threads(ahead.num_cpus, ahead.num_gpus, ahead.gpus_on_node)
    _take_environment(dict(os.environ))
    building = Ahead(ahead.start())
    with Connection(link.detach()) as handover:
        conn = Connection(recv_handle(handover))
        guarded.append(conn.fileno())
        hello = handover.recv()
    _take_output(conn)
    _enter(hello["cwd"])
    conn.send((READY, os.getpid()))
    Engines(conn, ahead=building, env=hello["env"]).serve()


class Ahead:
    """The engine a prestarted process builds on a thread of its own, from its start until an actor claims it."""

    def __init__(self, start: dict):
        from actors.engine import EngineProfile

        self.start = dict(start, profile=EngineProfile())  # an actor's first start has the default profile
        self.engine = self.error = None
        self.thread = threading.Thread(target=self._build, name="raysweep-engine-ahead", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        from actors.local_engine import InProcess

        try:
            self.engine = InProcess().start_engine(**self.start)
        except BaseException as e:  # noqa: BLE001  (the actor's own start runs instead)
            self.error = e

    def take(self, start: dict):
        """The engine, where `start` is the one it was built with; else None (closed, or its build failed, said
        in one line): the caller starts the actor's own."""
        self.thread.join()
        if self.error is not None:
            print(f"[raysweep] the engine started ahead of this actor failed ({type(self.error).__name__}: "
                  f"{self.error}); starting it again", file=sys.stderr, flush=True)
            return None
        if start != self.start:
            self.engine.close()
            return None
        return self.engine


def guard_group(connections: list[int]) -> None:
    """In a new process group's leader: a watchdog process that kills the group once this process is gone,
    however it went; and every process forked from this one from now on lets go of the `connections` (the
    actor's connection; a list the caller may add to) and of the watchdog's pipe, so none outlives this
    process in a child (vLLM's engine core)."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the watchdog: holds only the pipe's read end
        os.close(write_end)
        for fd in connections:
            os.close(fd)
        while os.read(read_end, 1):
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(0)
    os.close(read_end)

    def let_go() -> None:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in [*connections, write_end]:
            os.dup2(devnull, fd)  # the number stays valid (objects that own it close it harmlessly)
        os.close(devnull)

    os.register_at_fork(after_in_child=let_go)


def _take_output(conn: Connection) -> None:
    """The actor's stdout and stderr, sent after its hello, as this process's: what its engines print goes to the
    actor's log."""
    fds = [recv_handle(conn), recv_handle(conn)]
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # the host's were files (block-buffered); the actor's log is read live
        stream.reconfigure(line_buffering=True)


def _enter(folder: str) -> None:
    try:
        os.chdir(folder)
    except OSError:
        pass


def _set_threads(num_cpus: float, num_gpus: float, gpus_on_node: int) -> None:
    """The CPU threads an actor of this shape gives its engine: Ray's default for it (its CPUs), then the GPU
    actor's share of the machine (actors/engine_factory.py engine_cpu_threads)."""
    from actors.engine_factory import engine_cpu_threads

    os.environ["OMP_NUM_THREADS"] = str(max(int(num_cpus), 1))
    if num_gpus:
        engine_cpu_threads(num_cpus, num_gpus, gpus_on_node)


def _die_with_parent() -> None:
    """Killed when the host goes (Linux's parent-death signal), as long as no actor has claimed this process."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _take_environment(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # CUDA starts with the engine, not at a check
    os.environ.setdefault("RAYSWEEP_VLLM_CORE", "fork")  # not a Ray actor: vLLM's own way outside Ray
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and "torch" in sys.modules:  # torch read the host's at import
        sys.modules["torch"].set_num_threads(int(threads))


class Engines:
    """The engines of one actor, by id, each with the tokenizer its shards' prompts are encoded with."""

    def __init__(self, conn: Connection, ahead: Ahead | None = None, env: dict | None = None):
        self.conn = conn
        self.engines: dict[int, tuple] = {}
        self.ids = itertools.count()
        self.sending = threading.Lock()
        self.ahead, self.env = ahead, env  # a prestarted process: its engine, and the actor's environment
        self.claiming = threading.Lock()

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
        if self.ahead is not None:
            engine = self._claim(args if op == START else None)
            if engine is not None:
                return self._started(engine, "prestarted")
        if op == START:
            return self._start(args)
        if op == RUN_ROWS:
            engine_id, rows, task, add_special_tokens = args
            return self.engines[engine_id].run_rows(rows, task, add_special_tokens)
        if op == CALL:
            engine_id, method = args
            if method not in CALLS:
                raise ValueError(f"engine call {method!r}: not one of {', '.join(CALLS)}")
            engine = self.engines[engine_id]
            value = getattr(engine, method)()
            if method == "close":
                self.engines.pop(engine_id, None)
            return value
        raise ValueError(f"engine process: unknown call {op!r}")

    def _claim(self, start: dict | None):
        """A prestarted process's first call: its engine built ahead, taken where the call starts that engine
        (else closed); then the actor's environment, taken only now, once nothing is being built with the
        other."""
        with self.claiming:
            ahead, self.ahead = self.ahead, None
            if ahead is None:
                return None
            engine = ahead.take(start if start is not None else {})
            _take_environment(self.env)
            return engine

    def _start(self, kwargs: dict) -> dict:
        from actors.local_engine import InProcess

        return self._started(InProcess().start_engine(**kwargs), "host")

    def _started(self, engine, where: str) -> dict:
        engine_id = next(self.ids)
        self.engines[engine_id] = engine
        return {"id": engine_id, "kind": engine.kind, "profile": engine.profile,
                "startup": {**engine.startup(), "engine_process": where},
                "counters": hasattr(engine, "batch_counters")}


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
