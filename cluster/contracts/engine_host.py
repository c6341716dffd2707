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

from cluster.contracts.spec import ModelSpec

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


# The driver's message, once, before Ray starts: {PRESTART: [Prestart, ...]}. The host starts each engine at once
# in a process of its own, and hands that process to the first actor that comes with the same GPUs
# (`claim_key`); the engine is the actor's if it asks for the same start, else closed before the actor's own.
PRESTART = "prestart"


@dataclass(frozen=True)
class Prestart:
    """An engine started ahead of its actor: the actor's GPUs as Ray will give them (CUDA_VISIBLE_DEVICES), the
    actor's shape, and the start it will ask for (make_engine's model, path, threads and GPU share; the rest as
    an actor's first start has it)."""
    gpus: str
    num_cpus: float
    num_gpus: float
    gpus_on_node: int
    model: ModelSpec
    model_path: str

    def start(self) -> dict:
        """The keyword arguments an actor of this shape gives its first start, less the profile (the engine side
        adds its default one)."""
        return engine_start(self.model, self.model_path, self.num_cpus, self.num_gpus)


def engine_start(model: ModelSpec, model_path: str, num_cpus: float, num_gpus: float, sleep_mode: bool = False,
                 reproducible: bool = False) -> dict:
    """make_engine's keyword arguments (actors/engine_factory.py), less the profile, for an actor of this shape:
    its CPUs as the engine's threads, its GPU share (a CPU actor: the whole machine's)."""
    return {"model": model, "model_path": model_path, "num_threads": max(1, int(num_cpus)),
            "gpu_fraction": num_gpus if num_gpus else 1.0, "sleep_mode": sleep_mode, "reproducible": reproducible}


def claim_key(env: dict) -> str:
    """Which started-ahead engines an actor may take: those on its GPUs (none: the CPU)."""
    return env.get("CUDA_VISIBLE_DEVICES", "")
