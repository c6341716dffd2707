"""The commands. This is the first of raysweep's code that every command runs (`raysweep`, `python -m jobs.sweep`,
`python -m jobs.cli`, a `ray job submit` entrypoint): the moment is noted here, with the standard library only,
for the command's clock (`started_at`); and a command's first signals are its own from here (`_stopped_at_once`).
"""

import _signal  # the interpreter's own module, built in: no import stands between a command's start and its handlers
import os as _os
import sys as _sys
import time as _time

_ENTERED_AT, _CPU_AT_ENTRY = _time.time(), _time.process_time()
_STOPS = {_signal.SIGINT: "SIGINT", _signal.SIGTERM: "SIGTERM", _signal.SIGHUP: "SIGHUP"}  # the signals it handles


def _stopped_at_once(signum, frame) -> None:
    """Ctrl-C, SIGTERM or SIGHUP while the command imports its libraries, once its run is over and it exits, or in a
    command that runs no sweep (`raysweep plan`) (outside a run's own handlers, jobs/interrupts.py): no run is open
    then, so the command ends at once in one line, not Python's traceback of whichever import or exit function it
    was in. The line goes to the terminal also while lm-eval is kept quiet (its stderr is /dev/null then). In a
    child forked before its own handlers were dropped (`in_forked_child`), the child ends, without a word."""
    in_forked_child(signum)
    quiet = _sys.modules.get("cluster.lm_eval.quiet")  # looked up, not imported: a signal may come mid-import
    _os.write(quiet.terminal_stderr() if quiet is not None else 2,
              f"[raysweep] stopped by {_STOPS[signum]}: no sweep was running, none was cut "
              "short\n".encode())
    _os._exit(1)


def in_forked_child(signum: int) -> None:
    """A command's stop handler called in a process forked from it, before `_own_handlers_dropped_in_child` ran
    there (a signal to the whole group, as a terminal's Ctrl-C is, landing in the fork): that process ends at once,
    silent, by the signal's default action. The command says the run's line."""
    if _os.getpid() != _COMMAND_PID:
        _signal.signal(signum, _signal.SIG_DFL)
        _os.kill(_os.getpid(), signum)
        _os._exit(128 + signum)  # not reached: the default action of each of _STOPS ends the process


def _own_handlers_dropped_in_child() -> None:
    """In a process forked from a command (multiprocessing's fork: lm-eval's bootstrap pool; Ray's processes,
    forked and then run), the command's stop handlers (this module's and jobs/interrupts.py's, each marked
    `raysweep_stop`) give way to the default actions, SIGINT's also: that process is not the command. The pool ends
    its workers with SIGTERM, and the command's handler there said the command's stop line and waited for threads
    that do not exist after a fork, so the pool's join, and the run, waited for ever (seen: a sweep whose lm-eval
    perplexity metric bootstraps its stderr, under load). Python's own SIGINT handler raised KeyboardInterrupt in
    whichever code the child ran, between the fork and the program it runs: a library's fork hook, whose
    "Exception ignored" traceback came out beside the run's one line (seen: a Ctrl-C as Ray started)."""
    for signum in _STOPS:
        if getattr(_signal.getsignal(signum), "raysweep_stop", False):
            _signal.signal(signum, _signal.SIG_DFL)


_COMMAND_PID = _os.getpid()  # the command's process: a process forked from it has another
_stopped_at_once.raysweep_stop = True
_os.register_at_fork(after_in_child=_own_handlers_dropped_in_child)

# A command is `python -m jobs.X` (while Python imports the module's package, sys.argv[0] is "-m") or the installed
# `raysweep` script; a program that imports jobs (a test, a notebook) keeps its own handlers. Installed before any
# other import, through `_signal` (the `signal` module's import took long enough on a loaded machine for a Ctrl-C in
# it to be Python's traceback)
if _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "raysweep":
    for _s in _STOPS:
        _signal.signal(_s, _stopped_at_once)

try:  # had this process waited for child processes before Python started? (cluster/contracts/timing.py)
    import resource as _resource

    _CHILDREN_BEFORE_ENTRY = any(_resource.getrusage(_resource.RUSAGE_CHILDREN)[:4])  # CPU seconds, peak memory
except (ImportError, OSError):  # no `resource` (Windows)
    _CHILDREN_BEFORE_ENTRY = False


def started_at() -> float:
    """When the command's Python interpreter started (epoch seconds): a shell's sleep before an exec into
    raysweep is not counted, Python's start and imports are (timing.command_started_at says how)."""
    from cluster.contracts.timing import command_started_at

    return command_started_at(_ENTERED_AT, _CPU_AT_ENTRY, _CHILDREN_BEFORE_ENTRY)
