"""An actor's end of its engine process (actors/engine_process.py), forked from the run's engine host
(actors/engine_host.py): `connect` asks the host for one, `HostedEngine` is an engine there behind the
interface the actor uses (actors/engine.py, plus `run_rows` for a shard's rows, which run where the engine
and its tokenizer are).

If the engine process dies (an engine that broke exits its process, as it would exit an actor), this actor
exits too, so the scheduler retries its shards as after any actor's death.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Client, Connection
from multiprocessing.reduction import send_handle

from actors.engine import EngineProfile
from cluster.contracts.engine_host import (CALL, READY, RUN_ROWS, START, EngineHostAddress, claim_early,
                                           early_paths)

HOST_WAIT_S = 600.0  # the host's imports (vLLM: 10-25 s measured; a cold disk and no bytecode: more) at most


class EngineProcess:
    """The connection to this actor's engine process; calls from several threads at once. It starts and lets go
    of engines as actors/local_engine.py's `InProcess` does, so the actor does not ask which it has."""

    where = "host"

    def __init__(self, conn: Connection, pid: int):
        self.conn, self.pid = conn, pid
        self.closing = False
        self._ids = itertools.count()
        self._sending = threading.Lock()
        self._waiting: dict[int, list] = {}  # call id -> [event, ok, value]
        threading.Thread(target=self._read, name="raysweep-engine-process", daemon=True).start()

    def call(self, op: str, args):
        call_id = next(self._ids)
        slot = [threading.Event(), False, None]
        self._waiting[call_id] = slot
        with self._sending:
            self.conn.send((call_id, op, args))
        slot[0].wait()
        if not slot[1]:
            raise slot[2]
        return slot[2]

    def start_engine(self, **kwargs) -> "HostedEngine":
        started = self.call(START, kwargs)
        return HostedEngine(self, started["id"], started["kind"], started["profile"], started["startup"],
                            started["counters"], started["where"])

    def close(self, engines: list | None = None) -> None:
        """Let go of the engines: not shut down one by one, the engine process goes (with anything it still runs)
        and its group is killed (actors/engine_process.py), which frees the GPU at once; vLLM's own shutdown of
        an engine took about a second of every run's finish."""
        self.closing = True
        # shut down, not only closed: this actor's reader thread is inside recv on it, and a socket closed
        # under a blocked recv stays open (no end-of-file reaches the engine process)
        with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as end:
            end.shutdown(socket.SHUT_RDWR)
        self.conn.close()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except BaseException as e:  # noqa: BLE001  (gone, or an answer that cannot be read: the end)
                if self.closing:
                    return
                why = "ended" if isinstance(e, (EOFError, OSError)) else f"sent what this actor cannot read ({e!r})"
                print(f"[raysweep] engine process {self.pid} {why}: this actor ends with it", file=sys.stderr,
                      flush=True)
                os._exit(1)
            slot = self._waiting.pop(call_id)
            slot[1], slot[2] = ok, value
            slot[0].set()


class HostedEngine:
    """One engine in the engine process (actors/engine.py's interface, as the actor uses it). `where`: "host", or
    "early" for the early engine the driver asked for (cluster/contracts/engine_host.py), built before this actor
    asked."""

    def __init__(self, process: EngineProcess, engine_id: int, kind: str, profile: EngineProfile, startup: dict,
                 counters: bool, where: str = "host"):
        self.process, self.engine_id, self.kind, self.profile = process, engine_id, kind, profile
        self.where = where
        self._startup = startup  # fixed once the engine is up: read with its start, not once per shard
        if counters:
            self.batch_counters = lambda: self._call("batch_counters")

    def run_rows(self, rows: list[dict], task, add_special_tokens: bool):
        return self.process.call(RUN_ROWS, (self.engine_id, rows, task, add_special_tokens))

    def startup(self) -> dict:
        return dict(self._startup)

    def sleep(self) -> None:
        self._call("sleep")

    def wake_up(self) -> None:
        self._call("wake_up")

    def swap_weights(self, model_path: str) -> dict:
        return self._call("swap_weights", model_path)

    def close(self) -> None:
        self._call("close")

    def _call(self, method: str, *args):
        return self.process.call(CALL, (self.engine_id, method, *args))


def connect(address: EngineHostAddress | None, key: str | None = None) -> EngineProcess | None:
    """An engine process for this actor: an early engine of its `key` (cluster/contracts/engine_host.py
    engine_key) that no other actor claimed, where the driver asked for one, else one forked from the host at
    `address`; None where there is no host on this machine (an actor on another node) or it cannot fork one (its
    imports failed: it is gone). Waits while the host still imports."""
    if address is None or not os.path.exists(address.path):
        return None
    for early in early_paths(address, key) if key else []:
        if not claim_early(early):
            continue  # another actor of the same GPU's
        try:
            return _hello(Client(early, "AF_UNIX"), address.host_pid)
        except FileNotFoundError:  # the driver let go of it meanwhile
            break
        except (OSError, EOFError) as e:
            print(f"[raysweep] the early engine at {early} did not answer ({type(e).__name__}: {e}); this actor "
                  "asks the engine host for an engine process", file=sys.stderr, flush=True)
            break
    try:
        return _hello(Client(address.path, "AF_UNIX"), address.host_pid)
    except (OSError, EOFError) as e:
        print(f"[raysweep] the run's engine host did not answer ({type(e).__name__}: {e}); this actor runs its "
              "engines itself", file=sys.stderr, flush=True)
        return None


def _hello(conn: Connection, host_pid: int) -> EngineProcess | None:
    """This actor's environment, folder, stdout and stderr sent; the engine process's answer awaited."""
    conn.send({"env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()})
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        send_handle(conn, fd, host_pid)
    _await_answer(conn, host_pid)
    kind, pid = conn.recv()
    if kind != READY:
        conn.close()
        return None
    return EngineProcess(conn, pid)


def _await_answer(conn: Connection, host_pid: int) -> None:
    """Wait for the host's engine process to answer, while the host lives (it may still be importing), at most
    HOST_WAIT_S; a host that died or hangs raises, and the actor runs its engines itself."""
    deadline = time.monotonic() + HOST_WAIT_S
    while not conn.poll(1.0):
        try:
            os.kill(host_pid, 0)
        except ProcessLookupError:
            raise ConnectionError(f"the engine host (process {host_pid}) is gone") from None
        except PermissionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine host did not answer in {HOST_WAIT_S:.0f} s")
