"""The engine host of a local run (cluster/contracts/engine_host.py says why): `python -m actors.engine_host
SOCKET_FD BACKENDS DRIVER_PID`, started by the driver before Ray.

1. The driver made the socket and listens on it (SOCKET_FD, inherited), so an actor that connects at any
   time, even before this process's imports are done, waits in line.
2. It imports what the engines of BACKENDS need (actors/engine_factory.py PRELOADS), touching no GPU: a
   process that started CUDA cannot fork a working one.
3. For each actor that connects, it forks an engine process (actors/engine_process.py), which takes the
   actor's environment, folder and output, and runs the actor's engines until the actor goes.
4. Where the driver sent engines to start ahead (PRESTART, before Ray started), it forks a process for each at
   once, which builds its engine while Ray and the actors start; an actor that comes with those GPUs is handed
   that process instead of a new one.

It lives until the driver stops it, or dies with the driver (Linux's parent-death signal). It runs in a session
of its own, so Ctrl-C in the terminal is the driver's to handle. It writes nothing unless something fails.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from cluster.contracts.engine_host import PRESTART, claim_key


def main(argv: list[str]) -> int:
    server = socket.socket(fileno=int(argv[0]))
    backends, driver = [b for b in argv[1].split(",") if b], int(argv[2])
    _die_with_parent(driver)
    # torch's CUDA check through NVML, here and in every engine process: CUDA itself is never started before
    # an engine's own start, so vLLM can fork its engine core as it does outside Ray
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    from actors.engine_factory import preload

    preload(backends, core_process=False)
    import actors.engine_process  # noqa: F401  (and the shard code it runs)

    signal.signal(signal.SIGCHLD, _reap)
    ahead: dict[str, list] = {}  # claim key -> [(pid, link)]: engines started ahead, not claimed yet
    while True:
        client, _ = server.accept()
        conn = Connection(client.detach())
        try:
            hello = conn.recv() if conn.poll(HELLO_S) else None
            if isinstance(hello, dict) and PRESTART in hello:
                for one in hello[PRESTART]:
                    ahead.setdefault(claim_key({"CUDA_VISIBLE_DEVICES": one.gpus}), []).append(
                        _fork_ahead(one, server, ahead))
            elif isinstance(hello, dict) and not _hand_over(conn, hello, ahead.get(claim_key(hello["env"]), [])):
                _fork(conn, hello, server, ahead)
        except (OSError, EOFError) as e:  # no fork now (memory, process limits), or a client gone: that
            # actor runs its engines itself
            print(f"[raysweep] engine host: no engine process forked ({e})", file=sys.stderr, flush=True)
        finally:
            conn.close()


HELLO_S = 30.0  # an actor sends its hello as it connects: a connection silent this long is dropped


def _fork(conn, hello: dict, server: socket.socket, ahead: dict) -> None:
    """An engine process for the actor that sent `hello`."""
    if os.fork() == 0:
        _in_child(server, ahead)
        _serve(conn, hello)


def _fork_ahead(one, server: socket.socket, ahead: dict) -> tuple[int, socket.socket]:
    """A process that starts `one`'s engine now and waits to be handed its actor (actors/engine_process.py)."""
    from actors import engine_process

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        _in_child(server, ahead)
        ours.close()
        try:
            engine_process.prestarted(theirs, one)
        finally:
            engine_process.end()
    theirs.close()
    return pid, ours


def _hand_over(conn, hello: dict, waiting: list) -> bool:
    """The actor's connection and hello handed to an engine started ahead on its GPUs; False where none is left
    (or none took it: gone)."""
    while waiting:
        pid, link = waiting.pop(0)
        try:
            with Connection(link.detach()) as handover:
                send_handle(handover, conn.fileno(), pid)
                handover.send(hello)
            return True
        except OSError:
            continue
    return False


def _in_child(server: socket.socket, ahead: dict) -> None:
    """In a process forked from the host: the host's own ends let go."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    server.close()
    for waiting in ahead.values():
        for _, link in waiting:
            link.close()


def _serve(conn, hello: dict) -> None:
    """In the forked engine process: serve the actor; however that ends, the engine process's group goes
    (its engines' processes with it), without the host's exit handlers."""
    from actors import engine_process

    try:
        engine_process.serve(conn, hello)
    finally:
        engine_process.end()


def _reap(signum, frame) -> None:
    """Engine processes that ended: collected, so none stays a zombie for the host's life."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _die_with_parent(parent: int) -> None:
    """Be killed when the driver goes, however it goes (Linux; elsewhere the driver stops the host). A driver
    gone before this ran is seen by this process's parent no longer being it."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
