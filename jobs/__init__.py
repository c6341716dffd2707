"""The commands. This is the first of raysweep's code that every command runs (`raysweep`, `python -m jobs.sweep`,
`python -m jobs.cli`, a `ray job submit` entrypoint): the moment is noted here, with the standard library only,
for the command's clock (`started_at`)."""

import time as _time

_ENTERED_AT, _CPU_AT_ENTRY = _time.time(), _time.process_time()
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
