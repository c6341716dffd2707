"""lm-eval tasks whose own code raised while lm-eval scored a sweep's answers: a `process_results` that fails on the
engines' answers (the placeholders of the pass that built the requests did not reach the failing branch).

`scored_leaving_out_failures` runs the scoring of one `lm_eval:` entry with each task's `process_results` named:
where one raises, the task is recorded as failed with its exception (TaskFailed) and the entry is scored again
without it, so its neighbours' results are written (cluster/lm_eval/scores.py). A failed task's summary row
has no score and carries the error; the run says it in one line and exits 1. Its rows stay committed: the same
command, once the task is fixed, scores it from them without starting an engine.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from cluster.contracts.lm_eval_task import LmEvalSettings
from cluster.lm_eval.adapter import process_results_named


class TaskFailed(Exception):
    """A task's process_results raised; the message names the task and the exception."""

    def __init__(self, task: str, error: Exception):
        first = (str(error).strip().splitlines() or [""])[0][:300]
        super().__init__(f"lm-eval task {task}: its process_results raised {type(error).__name__}: {first}")
        self.task = task


def scored_leaving_out_failures(score: Callable[[LmEvalSettings], dict], settings: LmEvalSettings,
                                names: list[str]) -> tuple[dict | None, dict[str, str]]:
    """`score(settings)` (lm-eval's scoring of the entry's tasks `names`), again without each task that raised,
    until one pass raises nothing: its results (None where every task failed), and {task: why} of those left out.
    A group of the entry is scored as its remaining tasks, without the group's aggregate."""
    failed: dict[str, str] = {}
    while True:
        try:
            with process_results_named(TaskFailed):
                return score(settings), failed
        except TaskFailed as e:
            left = tuple(n for n in names if n not in failed and n != e.task)
            if e.task not in names:  # not one of the entry's tasks by name: none of them can be scored
                return None, {**failed, **{n: str(e) for n in left}}
            failed[e.task] = str(e)
            if not left:
                return None, failed
            settings = dataclasses.replace(settings, tasks=left)
