"""Where raysweep replaces parts of lm-eval at run time, in one place, for the one lm-eval release it is written
against (cluster/contracts/lm_eval_task.py VERSION): `require_version` stops on any other in one line before
lm-eval is used. Each replacement is a context manager or a subclass that puts lm-eval's own back:
- `without_run_record`: `simple_evaluate` without its environment record (a pass whose results nobody reads);
- `run_record_ahead`: `simple_evaluate`'s environment record taken on a thread while it evaluates;
- `templates_compiled_once`: `utils.apply_template` with each template compiled once;
- `own_request_cache`: lm-eval's request cache in a run's own folder (`request_cache_owned` tells);
- `own_tasks_indexed`: lm-eval's command line indexing only an include_path that holds every task named;
- `process_results_named`: each task's `process_results` raising an error that names the task;
- `command_line_checked`: lm-eval's checks of its command line raising one error of the caller's;
- `on_evaluate`: a call of the caller's at the moment lm-eval has loaded its tasks.
"""

from __future__ import annotations

import contextlib
import functools

from cluster.contracts.lm_eval_task import EXTRA, VERSION


class LmEvalVersionError(ValueError):
    """lm-eval is installed at a release raysweep is not written against."""


def require_version(installed: str | None = None) -> None:
    """One line where the installed lm-eval is not VERSION: the replacements below reach into its internals."""
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("lm_eval")
        except PackageNotFoundError:
            return  # an lm-eval without its metadata (a source checkout): its import decides
    if installed != VERSION:
        raise LmEvalVersionError(f"lm-eval {installed} is installed; raysweep works with lm-eval {VERSION} only "
                                 f"(it replaces some of lm-eval's internals): {EXTRA}")


@contextlib.contextmanager
def without_run_record():
    """lm-eval's `simple_evaluate` without the environment record it adds to its results: torch's
    `collect_env` (which imports torch and runs nvidia-smi, pip and others) and `git describe`. For a pass
    whose results nobody reads; lm-eval's own functions are back when the call ends."""
    import lm_eval.evaluator as evaluator

    saved = evaluator.add_env_info, evaluator.get_git_commit_hash
    evaluator.add_env_info, evaluator.get_git_commit_hash = (lambda results: None), (lambda: None)
    try:
        yield
    finally:
        evaluator.add_env_info, evaluator.get_git_commit_hash = saved


@contextlib.contextmanager
def run_record_ahead():
    """lm-eval's `simple_evaluate` with its environment record (`add_env_info`: torch's `collect_env`, which runs
    `pip list`, nvidia-smi and others and initialises CUDA, and `git describe`) taken on a thread from the call's
    start, while lm-eval scores, rather than after: stands in for `evaluator.py`'s `add_env_info(results)` once
    the results are made. The same fields, lm-eval's own function; on one H200 `collect_env` took 1.5 s with
    torch imported. lm-eval's own function is back when the call ends.

    The record names transformers' version, so its first import may happen there. transformers replaces its
    module in `sys.modules` with a lazy one at the end of its import, and a thread that imports it meanwhile is
    handed the module being replaced: `datasets`, hashing a task's dataset config on the caller's thread, then
    failed with "module 'transformers' has no attribute 'PreTrainedTokenizerBase'" (6 of 16 scoring passes of a
    complete output, whose driver had imported no transformers before, on the 2-core machine; 0 of 16 with this
    import). So transformers is imported here, on the caller's thread, before the record's thread starts
    (`imported_whole`): 0.4 s there with torch imported."""
    import threading

    import lm_eval.evaluator as evaluator

    imported_whole("transformers")
    saved, record = evaluator.add_env_info, {}

    def take() -> None:
        try:
            saved(record)
        except Exception:  # noqa: BLE001 - taken again in place, where lm-eval's own error is lm-eval's to raise
            record.clear()

    taking = threading.Thread(target=take, name="raysweep-run-record", daemon=True)
    taking.start()

    def add_env_info(results: dict) -> None:
        taking.join()
        if not record:  # lm-eval's own function failed on the thread: it runs here, as lm-eval runs it
            saved(record)
        results.update(record)

    evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        evaluator.add_env_info = saved


def imported_whole(name: str) -> None:
    """`name` imported on this thread where it is installed and not yet imported (a thread started later then finds
    it whole in `sys.modules`); nothing where it is not installed."""
    import importlib
    import importlib.util
    import sys

    if name not in sys.modules and importlib.util.find_spec(name) is not None:
        importlib.import_module(name)


@contextlib.contextmanager
def templates_compiled_once():
    """lm-eval's `utils.apply_template` with each template string compiled once: lm-eval compiles a task's
    `doc_to_text`/`doc_to_target`/`doc_to_choice` again for every document and every few-shot example (18,004
    compiles for 2 tasks of 1,200 documents with 2 shots: 23 of the 38 s that building their requests took on
    2 CPU cores). The same Jinja environment, the same template, rendered with the same document: the same
    text. lm-eval's own function is back when the call ends."""
    import lm_eval.utils as utils

    original, env = utils.apply_template, utils.env

    @functools.lru_cache(maxsize=256)
    def compiled(template: str):
        return env.from_string(template)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    utils.apply_template = apply_template
    try:
        yield
    finally:
        utils.apply_template = original


@contextlib.contextmanager
def own_request_cache(folder: str):
    """lm-eval's request cache in `folder` (a run's own) while the context lasts, lm-eval's path back after. Stands
    in for `PATH = OVERRIDE_PATH or f"{MODULE_DIR}/.cache"` (lm_eval/caching/cache.py: its package folder, or
    LM_HARNESS_CACHE_PATH), which lm-eval reads at each load and save."""
    import lm_eval.caching.cache as cache

    kept, cache.PATH = cache.PATH, folder
    try:
        yield folder
    finally:
        cache.PATH = kept


def request_cache_owned() -> bool:
    """Whether lm-eval's request cache is in a folder of a run's own (`own_request_cache`): lm-eval's own folder is
    shared by every process, and its key names neither a limit nor the data a cache was made from."""
    import lm_eval.caching.cache as cache

    return cache.PATH != (cache.OVERRIDE_PATH or f"{cache.MODULE_DIR}/.cache")


@contextlib.contextmanager
def own_tasks_indexed(names: list[str]):
    """lm-eval's command line with `task_manager`'s rule: a TaskManager it makes with an include_path that
    holds every task of `names` (its --tasks) indexes that folder only, not lm-eval's own 14,000 task files
    as well (14 s of a 77 s command on 2 CPU cores). A name the folder lacks (one of lm-eval's tasks, a YAML
    file's path): both, as lm-eval indexes them. lm-eval's own class is back when the call ends. Yields a
    callable giving the task names the last TaskManager made here knows (none made: an empty list), for
    `command_line_checked`'s closest names."""
    import lm_eval.tasks

    from cluster.lm_eval.task_index import OwnTasksFirst

    original = lm_eval.tasks.TaskManager
    made: list = []
    # lm-eval's command line makes its TaskManager by this name (lm_eval/config/evaluate_config.py process_tasks)
    lm_eval.tasks.TaskManager = functools.partial(OwnTasksFirst, tuple(names), made)
    try:
        yield lambda: list(made[0].all_tasks) if made else []
    finally:
        lm_eval.tasks.TaskManager = original


@contextlib.contextmanager
def process_results_named(failed: type):
    """While in force, each task lm-eval evaluates raises `failed(name, error)` from its process_results (failures.py
    TaskFailed), naming it. Wrapped per task object (whatever class defines the method), where lm-eval hands its
    tasks to `evaluate`."""
    import lm_eval.evaluator

    original = lm_eval.evaluator.evaluate

    def evaluate(*args, **kwargs):
        for name, task in _tasks(kwargs["task_dict"] if "task_dict" in kwargs else args[1]):
            task.process_results = _named(task.process_results, name, failed)
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


def _named(process_results, name: str, failed: type):
    def call(doc, results):
        try:
            return process_results(doc, results)
        except Exception as e:  # the task's own code: named, and its neighbours scored without it
            raise failed(name, e) from e

    return call


@contextlib.contextmanager
def command_line_checked(error: type[Exception], known_tasks=None):
    """lm-eval's checks of its own command line (its EvaluatorConfig: `Tasks not found: X`, a --config file that
    is not there, --samples with --limit ...) raise ValueError or FileNotFoundError, and its Task.doc_iterator
    asserts that each --samples index is below the task's document count, and more few-shot examples than a task
    has (--num_fewshot, `few_shots_checked`): `error` here, one line. `known_tasks`: a callable giving the task
    names lm-eval indexed (`own_tasks_indexed` yields one), for the closest names to each one not found. Stands in
    for `EvaluatorConfig.from_cli` and `.process_tasks` (lm_eval/config/evaluate_config.py) and `Task.doc_iterator`
    (lm_eval/api/task.py), each called through."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    def checked(method):
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except (ValueError, FileNotFoundError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise error(f"lm-eval: {first}{_closest(first, known_tasks)}") from None
        return call

    def samples_checked(method):
        def call(task, *args, **kwargs):
            try:
                return method(task, *args, **kwargs)
            except AssertionError as e:  # its --samples check: an index past the task's documents
                if not kwargs.get("samples"):
                    raise
                first = (str(e).strip().splitlines() or ["an index past the task's documents"])[0]
                raise error(f"lm-eval: --samples: task {task.config.task}: {first}") from None
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
        with few_shots_checked(error, "lm-eval: "):
            yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


NOT_FOUND = "Tasks not found: "  # lm-eval's line for --tasks names it has no task or group of (process_tasks)


def _closest(line: str, known_tasks) -> str:
    """For lm-eval's `Tasks not found: a, b`: the closest names it knows to each (`; closest to a: ...`)."""
    if known_tasks is None or not line.startswith(NOT_FOUND):
        return ""
    import difflib

    known = sorted(known_tasks())
    close = {name: difflib.get_close_matches(name, known, n=3) for name in line[len(NOT_FOUND):].split(", ")}
    return "".join(f"; closest to {name}: {', '.join(names)}" for name, names in close.items() if names)


class FewShotRefused(ValueError):
    """More few-shot examples asked of a task than its few-shot documents hold (`few_shot_refusal` says it)."""


@contextlib.contextmanager
def few_shots_checked(error: type[Exception] = FewShotRefused, prefix: str = ""):
    """lm-eval's Task.build_all_requests asks Python's random.sample for the few-shot examples: more than there are
    was its ValueError "Sample larger than population or is negative". `error(prefix + few_shot_refusal's line)`
    here. Stands in for `Task.build_all_requests` (lm_eval/api/task.py), called through."""
    from lm_eval.api.task import Task

    original = Task.__dict__.get("build_all_requests")
    if original is None:
        yield
        return

    @functools.wraps(original)
    def build_all_requests(task, *args, **kwargs):
        try:
            return original(task, *args, **kwargs)
        except ValueError:
            line = few_shot_refusal(task)
            if line is None:
                raise
            raise error(prefix + line) from None

    Task.build_all_requests = build_all_requests
    try:
        yield
    finally:
        Task.build_all_requests = original


def few_shot_refusal(task) -> str | None:
    """The line for a task asked for more few-shot examples than its few-shot documents hold (lm-eval's sampler
    draws one more where they are the documents evaluated, and drops the one being asked), or None where it was not
    asked for more."""
    try:
        shots = int(task.get_config("num_fewshot") or 0)
        docs = len(task.fewshot_docs())
        split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
        same = split is not None and split == task.get_config("test_split")
    except Exception:  # noqa: BLE001  (a task lm-eval builds another way: its own error stands)
        return None
    most = docs - 1 if same else docs
    if shots <= most:
        return None
    where = f"its few-shot split {split!r}" if split else "its few-shot documents"
    return (f"task {task.config.task}: num_fewshot {shots} is more than {where} can give ({docs} document(s)"
            f"{', less the one asked about' if same else ''}): give num_fewshot {max(most, 0)} or fewer")


@contextlib.contextmanager
def on_evaluate(before):
    """lm-eval's `evaluate` with `before(lm)` called first: the moment lm-eval has loaded its tasks (their datasets)
    and goes on to build their requests. Stands in for `simple_evaluate`'s `results = evaluate(lm=lm,
    task_dict=loaded, ...)` (lm_eval/evaluator.py), which names the module's `evaluate` at the call."""
    import lm_eval.evaluator as evaluator

    original = evaluator.evaluate

    @functools.wraps(original)
    def evaluate(*args, **kwargs):
        before(kwargs["lm"] if "lm" in kwargs else args[0])
        return original(*args, **kwargs)

    evaluator.evaluate = evaluate
    try:
        yield
    finally:
        evaluator.evaluate = original
