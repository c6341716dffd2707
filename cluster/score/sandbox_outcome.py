"""Reading how a program ended: the Outcome a run gives, from the bootstrap's word on its status pipe (its
exit code, or the exception it raised), else from the exit status alone.

`sys.exit(137)` is thus a failure with exit code 137, not a kill. Only a program that leaves by `os._exit`
is read from the exit status alone, where under bubblewrap a code above 128 reads as a signal (bwrap's
128 + N).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

from cluster.score.sandbox_types import ERROR_EXIT, SandboxLimits, _Plan


class ExecStatus(str, Enum):
    """How a program ended: a results row's `exec_status` (cluster/contracts/results_schema.py). A str: it is
    stored and printed as its value."""
    PASSED = "passed"  # its last statement ran
    FAILED = "failed"  # AssertionError, a non-zero exit, left before its end
    TIMEOUT = "timeout"  # its wall or CPU time ran out
    ERROR = "error"  # raised else, was killed, or its sandbox never started

    __str__ = str.__str__  # "passed", not "ExecStatus.PASSED" (as Python 3.11's StrEnum)
    __format__ = str.__format__


@dataclass
class Outcome:
    status: ExecStatus
    error: str | None      # last non-empty stderr line, or why (timed out, killed by signal N); None if passed
    exit_code: int | None  # the program's exit status; -N when killed by signal N; None when timed out
    wall_s: float
    stdout: str = ""
    stderr: str = ""
    started: bool = True   # False: its sandbox never started, on any try (status error); nothing of it ran


COMPLETED = "completed"  # the program's last statement ran: the only way to pass
FORGED = "forged"        # a completion line with a wrong token: a program claiming it ran to the end


def _ending(status: list[str], token: str) -> str | None:
    """The last of the bootstrap's status lines (after "ready") saying how the program ended, or None;
    "completed" only for the line carrying this run's token, and FORGED wherever any "completed" line carries
    another: only the harness holds the token, so a program guessing it gets one try."""
    if any(line.startswith(COMPLETED) and line != f"{COMPLETED} {token}" for line in status[1:]):
        return FORGED
    ends = [COMPLETED if line == f"{COMPLETED} {token}" else line for line in status[1:]
            if line in ("raised assert", "raised error", f"{COMPLETED} {token}") or
            (line[:5] == "exit " and line[5:].isdigit() and len(line) <= 8)]
    return ends[-1] if ends else None


def _classify(plan: _Plan, code: int, ended: str | None, timed_out: bool, limits: SandboxLimits, wall: float,
              stdout: str, stderr: str) -> Outcome:
    """`ended`: how the bootstrap saw the program end ("completed", "exit N", "raised assert|error"), FORGED
    where the program claimed completion with a wrong token, None where it never said (killed by a signal,
    or left by os._exit): then the exit status alone tells. Only a program that completed passes: one that
    left with code 0 before its end failed."""
    def outcome(status: ExecStatus, error: str | None, exit_code: int | None) -> Outcome:
        return Outcome(status, error, exit_code, wall, stdout, stderr)

    if timed_out:
        return outcome(ExecStatus.TIMEOUT, f"timed out after {limits.timeout_s:g} s", None)
    if ended == COMPLETED:
        return outcome(ExecStatus.PASSED, None, 0)
    if ended == FORGED:
        return outcome(ExecStatus.FAILED, "claimed to have run to the end with a token the harness did not give it "
                       "(a forged completion)", code)
    if ended is not None:  # the program's word wins over a status an atexit os._exit or a late signal changed
        code = int(ended.split()[1]) if ended.startswith("exit ") else 1 if ended == "raised assert" else ERROR_EXIT
    elif plan.bwrap and code > 128:  # bwrap reports its child's death by signal N as exit 128 + N
        code = 128 - code
    if code == 0:
        how = "sys.exit or SystemExit" if ended is not None else "os._exit, or its harness was ended"
        return outcome(ExecStatus.FAILED, f"left with exit code 0 before its last statement ran ({how})", 0)
    if code == -signal.SIGXCPU:
        cpu = limits.timeout_s if limits.cpu_s is None else limits.cpu_s
        return outcome(ExecStatus.TIMEOUT, f"CPU time limit of {cpu:g} s exceeded", code)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "unknown"
        return outcome(ExecStatus.ERROR, f"killed by signal {-code} ({name})", code)
    if ended == "raised error" or (ended is None and code == ERROR_EXIT):
        return outcome(ExecStatus.ERROR, _last_line(stderr) or "raised an exception", code)
    return outcome(ExecStatus.FAILED, _last_line(stderr) or f"exit code {code}", code)


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None
