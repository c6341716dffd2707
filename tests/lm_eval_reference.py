"""`python tests/lm_eval_reference.py ARGS` (tests/conftest.py LM_EVAL): lm-eval's own command line (`python -m
lm_eval ARGS`) with its task index built from `--include_path` alone, for the reference runs the parity tests compare
raysweep with. The tasks those runs name are the ones the tests write there; lm-eval's index of its thousands of
built-in task files, which they never read, took 11 of the 23 CPU-seconds of such a run on a 2-core machine, and the
results and per-document records are the same without it."""

import lm_eval.tasks.manager as manager
from lm_eval.__main__ import cli_evaluate

_build_index = manager.TaskManager.__init__


def _include_path_only(self, *args, **kwargs) -> None:
    kwargs["include_defaults"] = False  # TaskManager's own switch (lm_eval/tasks/manager.py)
    _build_index(self, *args, **kwargs)


if __name__ == "__main__":
    manager.TaskManager.__init__ = _include_path_only
    cli_evaluate()
