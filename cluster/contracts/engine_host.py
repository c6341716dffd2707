"""What a run's driver, its engine host and its actors agree on (cluster/launch.py starts the host,
actors/engine_host.py is it, actors/hosted_engine.py is an actor's end): where the host listens, and the
messages between an actor and the engine process the host forked for it.

Why a host: a sweep's actors exist only once Ray has started (4-6 s on a GPU machine), and each then
imported vLLM itself (15-20 s) before its engine could start. A plain script imports vLLM at once. The host
is a process of the driver's, started before Ray, that imports the engines' libraries while Ray starts;
each actor on the driver's machine then gets an engine process forked from it, imported already. That import is
vLLM's own (18.0-20.8 s on an H200, 0.06 s of it raysweep's modules: bench/records/h200-engine-host-import.md). A
run that joins a Ray cluster whose nodes all run on the driver's machine starts its host once Ray is joined
(jobs/lifecycle.py).

Early engines: where the driver knows before Ray is up which engine each actor will start first (cluster/plan/
early_engines.py), it asks the host for them at once, one per actor, each under the GPUs that actor will be given
(its key: actors that share a GPU share one, and their engines are told apart by slot); each is built in an engine
process forked for it that listens at `early_path(address, key, slot)`, a socket the driver bound before it asked
and sent with its message, so that an actor that comes while the host still imports finds it and waits there. An
actor takes the first engine of its key that no other actor has claimed (`claim_early`): its first `start_engine`
with the same arguments gets that engine, as soon as it is built. The driver lets go of one no actor will take, and
it ends. The engines' construction then overlaps Ray's start and the actors' own, instead of following them.
"""

from __future__ import annotations

import glob
import os
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
# The driver's message for an early engine: {EARLY: its key, "path": where it listens, "env": the environment it
# is built under (and keeps once an actor took it), "cwd", "start": the `start_engine` keyword arguments its actor
# will send but the profile, "threads": (num_cpus, num_gpus, node_gpus) for the engine's CPU threads}; nothing is
# answered, and the engine process ends when the driver's connection does, unless an actor took it by then.
EARLY = "early"
CPU_KEY = "cpu"  # the key of an actor without GPUs
READY = "ready"
# Calls, each (call id, op, args); each answer (call id, ok, value or exception).
START = "start"  # args: make_engine's keyword arguments -> {"id", "kind", "profile", "startup", "counters"}
RUN_ROWS = "run_rows"  # args: (engine id, rows, task, add_special_tokens) -> ShardOutcome
CALL = "call"  # args: (engine id, method name: sleep | wake_up | close | batch_counters) -> its value


def engine_key(gpu_ids) -> str:
    """An actor's key for early engines: the GPUs it was given (Ray's ids, as CUDA_VISIBLE_DEVICES names them), or
    CPU_KEY."""
    return ",".join(gpu_ids) if gpu_ids else CPU_KEY


def early_path(address: EngineHostAddress, key: str, slot: int = 0) -> str:
    """Where the early engine `slot` of `key` listens, beside the host's socket, until its actor takes it (a GPU
    that engines share has one early engine per actor of that GPU, slot 0, 1, ...)."""
    return os.path.join(os.path.dirname(address.path), f"early-{key.replace(',', '-')}.{slot}.sock")


def early_paths(address: EngineHostAddress, key: str) -> list[str]:
    """The early engines of `key` still listening (none taken yet), by slot."""
    return sorted(glob.glob(glob.escape(early_path(address, key, 0)[:-len("0.sock")]) + "*.sock"))


def claim_early(path: str) -> bool:
    """Whether this process is the first to claim the early engine at `path` (an atomic file beside its socket):
    actors that share a GPU share its key, and each takes an engine no other actor of the key has claimed."""
    try:
        os.close(os.open(path + ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True
