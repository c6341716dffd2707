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

import os
import sys

from jobs.lm_eval_run import LmEvalError, LmEvalRun


def run(argv: list[str]) -> int:
    from cluster.lm_eval.adapter import command_line_checked, on_evaluate, own_tasks_indexed, templates_compiled_once
    from cluster.lm_eval.run import import_lm_eval
    from jobs.interrupts import Interrupted, interrupted_in, interruptible
    from jobs.silence import SilenceWatch

    try:
        import_lm_eval()
    except ValueError as e:  # not installed: one line naming the extra
        print(f"raysweep: error: {e}", file=sys.stderr)
        return 2
    import jobs.lm_eval_model  # noqa: F401  (registers the model `raysweep`)
    from lm_eval.__main__ import cli_evaluate

    from cluster.lm_eval.requests import data_failure, is_data_error

    check_options(argv)
    sys.argv = ["lm_eval", *argv]
    run = LmEvalRun(SilenceWatch(lambda line: print(line, file=sys.stderr, flush=True)))
    run.stage("lm-eval reads its command line and indexes its tasks")
    try:
        with interruptible(say=run.say_stopped):
            try:
                with run.watch, run, templates_compiled_once(), own_tasks_indexed(task_names(argv)) as known, \
                        command_line_checked(LmEvalError, known), on_evaluate(_begin):
                    try:
                        cli_evaluate()
                    except Exception as e:  # a dataset not reachable: one line, as a spec's lm_eval: entry says it
                        if not is_data_error(e):
                            raise
                        raise LmEvalError(_named(argv, data_failure(e))) from None
                # the run closed inside the handlers: a signal during the close is one line, not a traceback
            except (Interrupted, SystemError) as e:
                # a SystemError raised from the Interrupted: the signal came inside ray.wait's C code (jobs/sweep.py)
                stop = e if isinstance(e, Interrupted) else interrupted_in(e)
                if stop is None:
                    raise
                run.say_stopped(stop)  # said at the signal already, unless Ray's own handler had it
                return 1
    except Interrupted:  # it came as the handlers were put in place: its line was said, nothing had started
        return 1
    return 0


def _named(argv: list[str], line: str) -> str:
    """`line` after the name of the task of `argv` that fails to load (cluster/lm_eval/requests.py failing_task)."""
    from cluster.contracts.lm_eval_task import LmEvalSettings
    from cluster.lm_eval.requests import failing_task
    from cluster.lm_eval.run import task_manager

    names = task_names(argv)
    try:
        include = getattr(lm_eval_options(argv), "include_path", None)
        name = failing_task(names, task_manager(LmEvalSettings(tasks=tuple(names), include_path=include)))
    except Exception:  # noqa: BLE001  (the line stands without the name)
        name = None
    return f"task {name}: {line}" if name else line


def _begin(lm) -> None:
    """lm-eval loaded its tasks and goes on to build their requests: raysweep's model begins its Ray (a model of
    lm-eval's own, or one behind --use_cache's CachingLM, is looked into)."""
    model = getattr(lm, "lm", lm)
    if hasattr(model, "begin"):
        model.begin()


def check_options(argv: list[str]) -> None:
    """What lm-eval would fail on later, said first (LmEvalError, one line): no --tasks (a traceback from lm-eval),
    a --use_cache path where lm-eval cannot keep its sqlite cache (after every request ran: cluster/lm_eval/scores.py
    check_cache, as a spec's `use_cache:` is checked), a --samples that is neither JSON nor a file, a --limit of 0
    or less (each a traceback from lm-eval). The options as lm-eval's own parser reads them (`--task`,
    `-c`, abbreviations); where it refuses them or prints its help, it does so itself once it runs."""
    from cluster.lm_eval.scores import check_cache

    options = lm_eval_options(argv)
    if options is None or argv[:1] in (["ls"], ["list"], ["validate"]):
        return
    if options.config is None and not options.tasks:  # else lm-eval's ValueError, as a traceback, once it has begun
        raise LmEvalError("--tasks: none named: name the lm-eval tasks to run (--tasks arc_easy,gsm8k; "
                          "`raysweep lm-eval ls tasks` lists them)")
    if options.use_cache is not None:
        try:
            check_cache(options.use_cache)
        except ValueError as e:
            raise LmEvalError(f"--{e}") from None
    if isinstance(options.samples, str) and not os.path.isfile(options.samples):  # else lm-eval's AttributeError
        raise LmEvalError(f"--samples {options.samples}: neither a JSON mapping of task to document indices nor a "
                          "file holding one")
    if options.limit is not None and options.limit <= 0:  # else lm-eval's "did not find any docs" traceback
        raise LmEvalError(f"--limit {options.limit:g}: must be above 0 (documents per task, or a fraction of them "
                          "below 1)")


def lm_eval_options(argv: list[str]):
    """`argv` as lm-eval's command line reads it (as `run` where it names no subcommand, as lm-eval does), or None
    where lm-eval's parser refuses it or prints its help."""
    import contextlib
    import io

    from lm_eval._cli.harness import HarnessCLI

    cli = HarnessCLI()
    command = argv if argv[:1] and argv[0] in cli._subparsers.choices else ["run", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return cli._parser.parse_args(command)
    except SystemExit:
        return None


def task_names(argv: list[str]) -> list[str]:
    """The task names lm-eval reads on `argv` (`--tasks a,b`, `--tasks a b`, `--task a`, `-t a`)."""
    options = lm_eval_options(argv)
    return [name.strip() for name in (getattr(options, "tasks", None) or []) if name.strip()]
