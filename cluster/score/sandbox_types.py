"""The sandbox's values: its error, the limits a program runs under, and a plan (one way to isolate it).

Stdlib only and imports nothing of the sandbox: every other sandbox module builds on these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NOBODY = 65534  # the unprivileged uid programs run as when the driver is root
ERROR_EXIT = 70  # the bootstrap's exit when the program raised something other than AssertionError


class SandboxError(RuntimeError):
    """The sandbox itself failed, not the program: no isolation works here, or a run did not start."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0      # wall clock from start to kill
    cpu_s: float | None = None   # CPU time of each process (RLIMIT_CPU, whole seconds up); None: timeout_s
    memory_mb: int = 1024        # address space of each process (RLIMIT_AS)
    max_processes: int = 32      # processes and threads of the program together (RLIMIT_NPROC)
    output_bytes: int = 65536    # output kept: the head of stdout and the tail of stderr, half each
    disk_mb: int = 64            # bytes it may write: its tmpfs (bwrap) and each file (RLIMIT_FSIZE)

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s"):
            value = getattr(self, name)
            if not (value is None and name == "cpu_s") and not (
                    isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        # memory_mb >= 64: below that the interpreter cannot start under RLIMIT_AS
        for name, low in (("memory_mb", 64), ("max_processes", 1), ("output_bytes", 2), ("disk_mb", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def rlimits(self) -> list[tuple[str, int, int]]:
        """(resource, soft, hard), soft = hard so the program cannot raise them; CPU: SIGXCPU at the soft
        limit, SIGKILL a second later should the program ignore it."""
        cpu = math.ceil(self.timeout_s if self.cpu_s is None else self.cpu_s)
        memory, disk = self.memory_mb << 20, self.disk_mb << 20
        return [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory, memory), ("RLIMIT_CORE", 0, 0),
                ("RLIMIT_NPROC", self.max_processes, self.max_processes), ("RLIMIT_FSIZE", disk, disk)]


@dataclass(frozen=True)
class _Plan:
    """One way to isolate; `_plan()` (sandbox_probe) takes the first under which a probe program runs as expected."""
    label: str
    bwrap: str | None       # "user": bwrap makes a user namespace; "root": bwrap runs as root; None: no bwrap
    popen_user: int | None  # uid to drop to before exec (bwrap then runs unprivileged)
    boot_uid: int | None    # uid the bootstrap, started as root, drops to
    early: int              # unshare flags before that drop (all but a user namespace need root)
    late: int               # unshare flags after it
    block_sockets: bool
    expect: frozenset[str]  # namespaces the probe must find new
    new: tuple[str, ...] = ()  # namespaces the probe found new
    as_driver: bool = False    # the program keeps the driver's own uid: only with unsafe_fallback

    def nobody_reads_python(self) -> bool:
        """Whether uid 65534 must reach the interpreter's install on the host (not through a root bwrap's bind)."""
        return self.popen_user == NOBODY or (self.bwrap is None and self.boot_uid == NOBODY)
