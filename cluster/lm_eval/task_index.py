"""lm-eval's index of task YAMLs as raysweep's command line has lm-eval build it (cluster/lm_eval/adapter.py
`own_tasks_indexed` puts it in the place of lm-eval's `TaskManager`). Imports lm-eval: imported only where it runs."""

from __future__ import annotations

from lm_eval.tasks.manager import TaskManager


class OwnTasksFirst(TaskManager):
    """lm-eval's TaskManager, except that one made with an include_path holding every task of `names` indexes that
    folder only, not lm-eval's own task files as well; otherwise both, as lm-eval's does. `made` holds the last one
    made. lm-eval's arguments follow `names` and `made` in lm-eval's order."""

    def __init__(self, names: tuple[str, ...], made: list, verbosity=None, include_path=None,
                 include_defaults: bool = True, metadata=None):
        narrow = include_defaults and include_path is not None and bool(names)
        super().__init__(verbosity, include_path, include_defaults and not narrow, metadata)
        if narrow and not all(name in self.all_tasks for name in names):
            super().__init__(verbosity, include_path, True, metadata)
        made[:] = [self]
