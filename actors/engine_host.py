"""The engine host of a local run (cluster/contracts/engine_host.py says why): `python -m actors.engine_host
SOCKET_FD BACKENDS DRIVER_PID`, started by the driver before Ray.

1. The driver made the socket and listens on it (SOCKET_FD, inherited), so an actor that connects at any
   time, even before this process's imports are done, waits in line.
2. It imports what the engines of BACKENDS need (actors/engine_factory.py PRELOADS), touching no GPU: a
   process that started CUDA cannot fork a working one.
3. For each actor that connects, it forks an engine process (actors/engine_process.py), which takes the
   actor's environment, folder and output, and runs the actor's engines until the actor goes.

It lives until the driver stops it, or dies with the driver (Linux's parent-death signal). It runs in a session
of its own, so Ctrl-C in the terminal is the driver's to handle. It writes nothing unless something fails.
"""

from __future__ import annotations

import os
import signal
import socket
import sys


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
    while True:
        client, _ = server.accept()
        try:
            if os.fork() == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                server.close()
                _serve(client)
        except OSError as e:  # no fork now (memory, process limits): that actor runs its engines itself
            print(f"[raysweep] engine host: no engine process forked ({e})", file=sys.stderr, flush=True)
        finally:
            client.close()


def _serve(client: socket.socket) -> None:
    """In the forked engine process: serve the actor; however that ends, the engine process's group goes
    (its engines' processes with it), without the host's exit handlers."""
    from actors import engine_process

    try:
        engine_process.serve(client)
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
