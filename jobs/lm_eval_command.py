"""`raysweep lm-eval ARGS`, the command's edge: lm-eval's command line (`lm_eval ARGS`) run with raysweep registered
as its model (jobs/lm_eval_model.py), each Jinja template of its tasks compiled once, and lm-eval's own tasks not
indexed where --include_path holds every task named (cluster/lm_eval/adapter.py).

lm-eval's own checks of its command line are one line (LmEvalError). Ctrl-C, SIGTERM or SIGHUP at any moment
(its imports, Ray's start, lm-eval building its requests, a sweep, the engines' close) is one line, exit 1, as
`raysweep run` says its stop (jobs/interrupts.py): the line at the signal, then the model's engines, Ray and
temporary output closed before the command ends (a second signal ends it at once). A local Ray whose head is lost
during a sweep ends the command the same way (jobs/head_watch.py).
"""

from __future__ import annotations

import contextlib
import os
import sys

from jobs.lm_eval_model import LmEvalError


def run(argv: list[str]) -> int:
    from cluster.lm_eval.adapter import own_tasks_indexed, templates_compiled_once
    from cluster.lm_eval.run import import_lm_eval
    from jobs import lm_eval_model
    from jobs.interrupts import Interrupted, interrupted_in, interruptible

    try:
        import_lm_eval()
    except ValueError as e:  # not installed: one line naming the extra
        print(f"raysweep: error: {e}", file=sys.stderr)
        return 2
    lm_eval_model.register()
    from lm_eval.__main__ import cli_evaluate

    from cluster.inputs.builtin_model import hub_unreachable
    from cluster.lm_eval.requests import DATA_ERRORS, data_failure

    if hub_unreachable():  # `datasets` would try the hub for minutes, silent, before its ConnectionError
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")

    check_options(argv)
    sys.argv = ["lm_eval", *argv]
    with interruptible(say=lm_eval_model.say_stopped):
        try:
            try:
                with templates_compiled_once(), own_tasks_indexed(task_names(argv)), _command_line_checked():
                    try:
                        cli_evaluate()
                    except Exception as e:  # a dataset not reachable: one line, as a spec's lm_eval: entry says it
                        if type(e).__name__ not in DATA_ERRORS:
                            raise
                        raise LmEvalError(data_failure(e)) from None
            finally:  # inside the handlers: a signal during the close is one line, not a traceback from atexit
                lm_eval_model.close()
        except (Interrupted, SystemError) as e:
            # a SystemError raised from the Interrupted: the signal came inside ray.wait's C code (jobs/sweep.py)
            stop = e if isinstance(e, Interrupted) else interrupted_in(e)
            if stop is None:
                raise
            lm_eval_model.say_stopped(stop)  # said at the signal already, unless Ray's own handler had it
            return 1
    return 0


def check_options(argv: list[str]) -> None:
    """What lm-eval would fail on only after every request ran, said first (LmEvalError, one line): a --use_cache
    path where lm-eval cannot keep its sqlite cache (cluster/lm_eval/scores.py check_cache, as a spec's
    `use_cache:` is checked)."""
    from cluster.lm_eval.scores import check_cache

    for path in option_values(argv, "--use_cache"):
        try:
            check_cache(path)
        except ValueError as e:
            raise LmEvalError(f"--{e}") from None


def option_values(argv: list[str], option: str) -> list[str]:
    """The values given to `option` on `argv` (`--option VALUE` or `--option=VALUE`)."""
    found = []
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            found.append(arg.split("=", 1)[1])
        elif arg == option and i + 1 < len(argv):
            found.append(argv[i + 1])
    return found


def task_names(argv: list[str]) -> list[str]:
    """The task names of lm-eval's `--tasks a,b` (or `--tasks a b`, `--tasks=a,b`) on `argv`."""
    names, taking = [], False
    for arg in argv:
        if arg.startswith("--tasks="):
            names += arg.split("=", 1)[1].split(",")
            taking = False
        elif arg in ("--tasks", "-t"):
            taking = True
        elif taking and not arg.startswith("-"):
            names += arg.split(",")
        else:
            taking = False
    return [name.strip() for name in names if name.strip()]


@contextlib.contextmanager
def _command_line_checked():
    """lm-eval's checks of its own command line (its EvaluatorConfig: `Tasks not found: X`, a --config file that
    is not there, --samples with --limit ...) raise ValueError or FileNotFoundError, and its Task.doc_iterator
    asserts that each --samples index is below the task's document count: LmEvalError here, one line."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    def checked(method):
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except (ValueError, FileNotFoundError) as e:
                raise LmEvalError(f"lm-eval: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
        return call

    def samples_checked(method):
        def call(task, *args, **kwargs):
            try:
                return method(task, *args, **kwargs)
            except AssertionError as e:  # its --samples check: an index past the task's documents
                if not kwargs.get("samples"):
                    raise
                first = (str(e).strip().splitlines() or ["an index past the task's documents"])[0]
                raise LmEvalError(f"lm-eval: --samples: task {task.config.task}: {first}") from None
        return call

    originals = {(EvaluatorConfig, name): EvaluatorConfig.__dict__[name] for name in ("from_cli", "process_tasks")
                 if name in EvaluatorConfig.__dict__}
    for (owner, name), original in originals.items():
        if isinstance(original, classmethod):
            setattr(owner, name, classmethod(checked(original.__func__)))
        else:
            setattr(owner, name, checked(original))
    from lm_eval.api.task import Task

    if "doc_iterator" in Task.__dict__:  # asserts that each --samples index is one of the task's documents
        originals[(Task, "doc_iterator")] = Task.__dict__["doc_iterator"]
        Task.doc_iterator = samples_checked(originals[(Task, "doc_iterator")])
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
