"""A sandbox for untrusted, model-generated Python programs (the `code_exec` scorer runs them here).

Each program runs in a process of its own, under the driver's interpreter with the standard library only
(`-I -S`: no site-packages, no PYTHON* variables), in a fresh empty directory gone afterwards, with a
minimal environment (PATH, HOME, LANG), limits on wall clock, CPU time, address space, processes (a fork
bomb stops at `max_processes`), bytes written and output kept, and oom_score_adj 1000, so that under
memory pressure the kernel's OOM killer takes a sandbox before the driver.

Which plan applies is measured once by a probe program: `check_available()` says it in one line, or raises
SandboxError naming why none applies. The plans, strongest first, and what each protects against:
- bubblewrap (`bwrap` >= 0.8, Debian package `bubblewrap`), the driver root or not: new mount, pid,
  network, ipc, uts and user namespaces; the program sees /usr, the interpreter's prefix and a few /etc
  files read-only, a private /proc and /dev, and a tmpfs /tmp of `disk_mb` as its directory; as uid 65534
  where the driver is root (rlimits do not bind root). It cannot read the driver's environment or any file
  beyond those binds, write outside its tmpfs, open a network connection, or see or signal a process
  outside its pid namespace, which dies with it.
- root without bubblewrap: the program runs as uid 65534, in new network, ipc, uts and user namespaces
  where the kernel allows, with sockets blocked inside Python. It cannot signal the driver or read what
  only root can read, but it shares the pid namespace and uid 65534 with every other sandbox: it can kill
  a neighbour's program (recorded as killed by a signal) or any uid-65534 process on the host. It can also
  read world-readable files, write to world-writable directories (/tmp, /dev/shm), use host Unix sockets,
  reach the network through ctypes or a subprocess where no network namespace could be made, and leave
  behind a process that called setsid.
- not root without bubblewrap: refused. The program would keep the driver's own uid (it only shows as
  65534 inside a user namespace): it could read and change every file the driver can and kill the driver.
  Only a task with `unsafe_fallback: true` runs so.
No plan protects against kernel exploits (no seccomp filter; the kernel is shared; with bwrap run as root
the program may create nested user namespaces), timing and cache side channels, CPU and memory-bandwidth
starvation of neighbours within the limits, memory summed over processes (no cgroup: `memory_mb` binds
each process, so up to `max_processes` x `memory_mb` in all), or a program that cheats on purpose by reading
its own raw memory for the completion token (sandbox_bootstrap says where it is kept, out of reach of
anything a program can name) or by making its tests pass without meeting them. Leaving early fails.

How a program ended is what the bootstrap reports on a pipe (its exit code, or the exception it raised), so
`sys.exit(137)` is a failure with exit code 137, not a kill. Only a program that leaves by `os._exit` is
read from the exit status alone, where under bubblewrap a code above 128 reads as a signal (bwrap's 128 + N).
A program whose sandbox fails to start (SandboxError, or an OSError such as EAGAIN from fork) is tried
again, then recorded as an `error` with `started` False; a batch fails only when none of it started.

This module is the sandbox's interface (what callers import); the parts live beside it, each importing only
those listed before it: sandbox_types (SandboxError, SandboxLimits, a plan), sandbox_bootstrap (what runs
first inside a sandbox), sandbox_outcome (how a program ended), sandbox_launch (one program under a given
plan), sandbox_probe (which plan applies: check_available, run_program), sandbox_pool (SandboxPool).
"""

from __future__ import annotations

from cluster.score.sandbox_bootstrap import BOOTSTRAP
from cluster.score.sandbox_outcome import ExecStatus, Outcome
from cluster.score.sandbox_pool import RETRY_PAUSES_S, SandboxPool
from cluster.score.sandbox_probe import check_available, run_program
from cluster.score.sandbox_types import ERROR_EXIT, NOBODY, SandboxError, SandboxLimits

__all__ = ["BOOTSTRAP", "ERROR_EXIT", "ExecStatus", "NOBODY", "RETRY_PAUSES_S", "Outcome", "SandboxError",
           "SandboxLimits", "SandboxPool", "check_available", "run_program"]
