"""What a local run's driver, its engine host and its actors agree on (cluster/launch.py starts the host,
actors/engine_host.py is it, actors/hosted_engine.py is an actor's end): where the host listens, and the
messages between an actor and the engine process the host forked for it.

Why a host: a sweep's actors exist only once Ray has started (4-6 s on a GPU machine), and each then
imported vLLM itself (15-20 s) before its engine could start. A plain script imports vLLM at once. The host
is a process of the driver's, started before Ray, that imports the engines' libraries while Ray starts;
each actor on the driver's machine then gets an engine process forked from it, imported already.
"""

from __future__ import annotations

from dataclasses import dataclass

HOST_MODULE = "actors.engine_host"  # run as `python -m actors.engine_host SOCKET_FD BACKENDS DRIVER_PID`


@dataclass(frozen=True)
class EngineHostAddress:
    """The host's Unix socket, in a folder only this user can enter (that is its authentication), and its
    process id (an actor on another machine finds no such socket and runs its engine itself)."""
    path: str
    host_pid: int

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("EngineHostAddress.path: empty")


# An actor's first message: {"env": its environment, "cwd": its folder, "pid": its process}, then its
# stdout and stderr as file descriptors; the engine process answers READY with its pid once it exists.
READY = "ready"
# Calls, each (call id, op, args); each answer (call id, ok, value or exception).
START = "start"  # args: make_engine's keyword arguments -> {"id", "kind", "profile", "startup", "counters"}
RUN_ROWS = "run_rows"  # args: (engine id, rows, task, add_special_tokens) -> ShardOutcome
CALL = "call"  # args: (engine id, method name: sleep | wake_up | close | batch_counters) -> its value
