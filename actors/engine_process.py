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

from cluster.contracts.engine_host import CALL, READY, RUN_ROWS, START

CALLS = ("startup", "sleep", "wake_up", "close", "batch_counters")


def serve(client: socket.socket) -> int:
    conn = Connection(client.detach())
    os.setsid()
    hello = conn.recv()
    fds = [recv_handle(conn), recv_handle(conn)]
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    _take_environment(hello["env"])
    try:
        os.chdir(hello["cwd"])
    except OSError:
        pass
    conn.send((READY, os.getpid()))
    Engines(conn).serve()
    return 0


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

    def __init__(self, conn: Connection):
        self.conn = conn
        self.engines: dict[int, tuple] = {}
        self.ids = itertools.count()
        self.sending = threading.Lock()

    def serve(self) -> None:
        while True:
            try:
                call_id, op, args = self.conn.recv()
            except (EOFError, OSError):
                _end()
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
        except (OSError, ValueError, pickle.PicklingError) as e:
            if isinstance(e, OSError):
                _end()
            with self.sending:
                self.conn.send((call_id, False, RuntimeError(f"the engine's answer could not be sent: {e}")))

    def _do(self, op: str, args):
        if op == START:
            return self._start(args)
        if op == RUN_ROWS:
            from actors.shard_work import run_rows

            engine_id, rows, task, add_special_tokens = args
            engine, tokenizer = self.engines[engine_id]
            return run_rows(engine, rows, task, tokenizer, add_special_tokens)
        if op == CALL:
            engine_id, method = args
            if method not in CALLS:
                raise ValueError(f"engine call {method!r}: not one of {', '.join(CALLS)}")
            engine, _ = self.engines[engine_id]
            value = getattr(engine, method)()
            if method == "close":
                self.engines.pop(engine_id, None)
            return value
        raise ValueError(f"engine process: unknown call {op!r}")

    def _start(self, kwargs: dict) -> dict:
        from actors.engine_factory import make_engine

        engine = make_engine(**kwargs)
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(kwargs["model_path"])
        engine_id = next(self.ids)
        self.engines[engine_id] = (engine, tokenizer)
        return {"id": engine_id, "kind": engine.kind, "profile": engine.profile,
                "counters": callable(getattr(engine, "batch_counters", None))}


def _portable(e: BaseException) -> BaseException:
    """The exception itself where it pickles, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def _end() -> None:
    """The actor is gone: this process and its engines' processes go too."""
    os.killpg(os.getpgrp(), signal.SIGKILL)
