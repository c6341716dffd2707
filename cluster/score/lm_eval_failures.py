"""lm-eval tasks whose own code raised while lm-eval scored a sweep's answers: a `process_results` that fails on the
engines' answers (the placeholders of the pass that built the requests did not reach the failing branch).

`scored_leaving_out_failures` runs the scoring of one `lm_eval:` entry with each task's `process_results` named:
where one raises, the task is recorded as failed with its exception (TaskFailed) and the entry is scored again
without it, so its neighbours' results are written (cluster/score/lm_eval_scores.py). A failed task's summary row
has no score and carries the error; the run says it in one line and exits 1. Its rows stay committed: the same
command, once the task is fixed, scores it from them without starting an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

from cluster.contracts.lm_eval_task import LmEvalSettings


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
            with _process_results_named():
                return score(settings), failed
        except TaskFailed as e:
            left = tuple(n for n in names if n not in failed and n != e.task)
            if e.task not in names:  # not one of the entry's tasks by name: none of them can be scored
                return None, {**failed, **{n: str(e) for n in left}}
            failed[e.task] = str(e)
            if not left:
                return None, failed
            settings = dataclasses.replace(settings, tasks=left)


@contextlib.contextmanager
def _process_results_named():
    """While in force, each task lm-eval evaluates raises TaskFailed from its process_results, naming it. Wrapped
    per task object (whatever class defines the method), where lm-eval hands its tasks to `evaluate`."""
    import lm_eval.evaluator

    original = lm_eval.evaluator.evaluate

    def evaluate(*args, **kwargs):
        for name, task in _tasks(kwargs["task_dict"] if "task_dict" in kwargs else args[1]):
            task.process_results = _named(task.process_results, name)
        return original(*args, **kwargs)

    lm_eval.evaluator.evaluate = evaluate
    try:
        yield
    finally:
        lm_eval.evaluator.evaluate = original


def _tasks(task_dict: dict):
    """(name, task) of every task in lm-eval's task dict (nested: groups hold dicts of their tasks)."""
    for key, value in task_dict.items():
        if isinstance(value, dict):
            yield from _tasks(value)
        elif hasattr(value, "process_results"):
            yield getattr(getattr(value, "config", None), "task", None) or str(key), value


def _named(process_results, name: str):
    def call(doc, results):
        try:
            return process_results(doc, results)
        except Exception as e:  # the task's own code: named, and its neighbours scored without it
            raise TaskFailed(name, e) from e

    return call
