"""What a command's local Ray leaves running when the command is killed (kill -9, an abort, an exit that skipped its
cleanup), ended within a second or two.

Ray (2.60) starts its head processes so that Linux kills them with the driver (PR_SET_PDEATHSIG), but not what
they start: the raylet's dashboard agent and runtime env agent, their raylet gone, spend a minute trying to report
it to the GCS that died too (ray/_private/process_watcher.py), and a worker or an engine process whose parent was
killed is left to init. The reaper is a small process of its own session (a Ctrl-C or a SIGTERM to the command's
process group does not reach it) started before ray.init: every REAPER_LOOK_S it notes the processes descended from
the driver (pid and start time: a pid used again later is not taken for one of them). Its stdin is a pipe from
the driver: where the driver stopped its Ray itself, it writes RELEASED and the reaper ends; where the pipe closes
without it, the driver is gone and the reaper kills every process it noted that still runs, and any of theirs.
Only the driver's own descendants: other Rays on the machine are never touched.

Standard library only, run by path (`python -I -S ray_reaper.py PID`): it starts in milliseconds and needs none
of the project.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

REAPER_LOOK_S = 0.5  # how often the reaper notes the driver's descendants (a full read of /proc: about a millisecond)
RELEASED = b"released\n"  # the driver's word that it stopped its Ray itself: nothing to kill
KILL_ROUNDS_S = 2.0  # after the driver's death, how long the reaper looks for processes started meanwhile


class Reaper:
    """The driver's side: the reaper started now, watching this process; `release()` once the command's own stop
    of its Ray is done."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def release(self) -> None:
        try:
            self.process.stdin.write(RELEASED)
            self.process.stdin.close()
        except OSError:  # it ended (killed by someone): nothing to tell
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every process in /proc that runs (a zombie has
    ended: it waits only to be reaped)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
        if fields[0] != b"Z":
            found[int(name)] = (int(fields[1]), int(fields[19]))
    return found


def _descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """pid -> start time of the processes below `roots` in `table` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found[child] = table[child][1]
                todo.append(child)
    return found


def _watch(driver: int) -> dict[int, int] | None:
    """The driver's descendants as last noted when its pipe closed; None where it released the reaper."""
    noted: dict[int, int] = {}
    said = b""
    while True:
        ready, _, _ = select.select([0], [], [], REAPER_LOOK_S)
        if ready:
            data = os.read(0, 64)
            said += data
            if not data:
                return None if said.endswith(RELEASED) else noted
        table = _processes()
        noted = {pid: start for pid, start in noted.items() if table.get(pid, (0, None))[1] == start}
        noted.update(_descendants({driver}, table))


def _kill(noted: dict[int, int]) -> None:
    """SIGKILL to each noted process still running, and to those they started since, until none is left or
    KILL_ROUNDS_S is over."""
    give_up = time.monotonic() + KILL_ROUNDS_S
    while noted and time.monotonic() < give_up:
        table = _processes()
        alive = {pid: start for pid, start in noted.items() if table.get(pid, (0, None))[1] == start}
        alive.update(_descendants(set(alive), table))
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        noted = alive
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the command does not end the reaper first
    noted = _watch(int(argv[0]))
    if noted:
        _kill(noted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
