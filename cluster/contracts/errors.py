"""The one error base that the edge of a raysweep process catches (jobs/sweep.py `guarded`): a
`RaysweepError` is printed as one line, `raysweep: error: MESSAGE`, and the process exits with its
`exit_code`; anything else is a bug and keeps its traceback. Each stage raises its own subclass, named
for what it checks; inner code only raises."""

from __future__ import annotations


class RaysweepError(Exception):
    """An input, a setting or a place that cannot be used as asked; the message names the file, line or field."""
    exit_code = 2


class PreflightError(RaysweepError, ValueError):
    """Raised before any actor starts: a model, task, file or field that cannot run, or rows the task's
    length policy refuses; the message names them."""
