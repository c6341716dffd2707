"""lm-eval as raysweep calls it (docs/lm-eval.md): the one `simple_evaluate` call that both builds a `lm_eval:`
entry's requests (cluster/inputs/lm_eval_tasks.py) and scores its results (cluster/score/lm_eval_scores.py),
and `request_rows`, the rule that makes requests into a task's rows, which scoring applies again to find each
request's answer. lm-eval is imported only inside these functions: it is an optional extra.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import threading
from collections import defaultdict
from typing import Iterable

from cluster.contracts.lm_eval_task import EXTRA, LmEvalSettings
from cluster.harness.lm_eval_quiet import quiet


def import_lm_eval():
    try:
        import lm_eval.evaluator  # noqa: F401
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        raise ValueError(f"lm-eval is not installed ({e}); {EXTRA}") from None
    import lm_eval
    return lm_eval


def with_chat_template(lm, tokenizer):
    """`lm` (an lm-eval model) rendering chat templates with `tokenizer`, as lm-eval's HF model does: its
    `apply_chat_template` (the system message dropped where the template refuses one), `chat_template` and
    `tokenizer_name` (which lm-eval's request cache and results name). None: `lm` as it is."""
    if tokenizer is None:
        return lm
    import jinja2

    class ChatTemplated(type(lm)):
        @property
        def tokenizer_name(self) -> str:
            return tokenizer.name_or_path.replace("/", "__")

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return tokenizer.chat_template if chat_template else None

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            def render(history):
                return tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=not add_generation_prompt)
            try:
                return render(chat_history)
            except jinja2.exceptions.TemplateError:
                return render([m for m in chat_history if m["role"] != "system"])

    lm.__class__ = ChatTemplated
    return lm


def run_lm_eval(settings: LmEvalSettings, lm, task_manager, log_samples: bool, bootstrap_iters: int,
                tracker=None, requests_only: bool = False) -> dict:
    """lm-eval's `simple_evaluate` with the entry's settings: the one call that builds and that scores.
    Without a `limit` or `samples`, lm-eval's request cache is on, in a folder of this process's own: the scoring
    pass reads the requests the building pass made (lm-eval renders each document's few-shot context again
    otherwise, about half of a pass), and no later process can read a cache made from other data (its key names
    neither the limit nor the samples). `requests_only` (the building pass, whose results are thrown away):
    without what only the results record (`without_run_record`), without seeding torch (a model's sampling; no
    request depends on it): torch is not imported for it; and without predict_only (which changes only the
    metrics). The answers cache (`use_cache`) is the scoring model's own (cluster/score/lm_eval_scores.py)."""
    import lm_eval.evaluator

    _own_request_cache()
    random_seed, numpy_seed, torch_seed, fewshot_seed = settings.seeds
    if not requests_only and _AHEAD["thread"] is not None:
        _AHEAD["thread"].join()
    with templates_compiled_once(), (without_run_record() if requests_only else contextlib.nullcontext()):
        return lm_eval.evaluator.simple_evaluate(
            # with a limit lm-eval's request cache would build every document; its key names no samples
            cache_requests=settings.limit is None and settings.samples is None,
            model=lm, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot, limit=settings.limit,
            samples=settings.samples, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
            system_instruction=settings.system_instruction, apply_chat_template=settings.apply_chat_template,
            fewshot_as_multiturn=settings.fewshot_as_multiturn, gen_kwargs=settings.gen_kwargs,
            task_manager=task_manager, predict_only=settings.predict_only and not requests_only,
            random_seed=random_seed, numpy_random_seed=numpy_seed, fewshot_random_seed=fewshot_seed,
            torch_random_seed=None if requests_only else torch_seed,
            confirm_run_unsafe_code=settings.confirm_run_unsafe_code, evaluation_tracker=tracker)


_AHEAD: dict = {"thread": None}  # the thread `score_ahead` started in this process


def score_ahead() -> None:
    """While a sweep's shards run, once per process: torch imported on a daemon thread. lm-eval's scoring pass
    seeds torch first (`set_torch_seed`); on the 2-core CPU machine torch's import was 2.8 s of a 4.7 s scoring
    pass after the last result (300 + 300 documents, builtin:tiny). The scoring pass waits for the thread
    (`run_lm_eval`). lm-eval's environment record stays in the scoring pass, inside `quiet()` and after the
    engines have closed: torch's collect_env initialises CUDA and prints what it warns of."""
    def take() -> None:
        try:
            import torch  # noqa: F401
        except Exception:  # noqa: BLE001 - the scoring pass imports it again, and says what fails
            pass

    if _AHEAD["thread"] is None:
        _AHEAD["thread"] = threading.Thread(target=take, name="raysweep-score-ahead", daemon=True)
        _AHEAD["thread"].start()


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


@functools.lru_cache(maxsize=1)
def _own_request_cache() -> str:
    """lm-eval's request cache moved from its package folder to a temporary one removed at exit."""
    import atexit
    import shutil
    import tempfile

    import lm_eval.caching.cache as cache

    folder = tempfile.mkdtemp(prefix="raysweep-lm-eval-requests-")
    atexit.register(shutil.rmtree, folder, True)
    cache.PATH = folder  # read by lm-eval at each load and save
    return folder


def task_manager(settings: LmEvalSettings):
    """lm-eval's index of task YAMLs, built once per folder in a process, for building requests and for
    scoring them. Where the include_path holds every task named, only it is indexed (lm-eval's own tasks
    are some 14,000 files, 6-9 s to read); otherwise lm-eval's tasks too, as its command line does."""
    if settings.include_path is not None:
        own = _task_manager(settings.include_path, False)
        if all(name in own.all_tasks for name in settings.tasks):
            return own
    return _task_manager(settings.include_path, True)


@contextlib.contextmanager
def own_tasks_indexed(names: list[str]):
    """lm-eval's command line with `task_manager`'s rule: a TaskManager it makes with an include_path that
    holds every task of `names` (its --tasks) indexes that folder only, not lm-eval's own 14,000 task files
    as well (14 s of a 77 s command on 2 CPU cores). A name the folder lacks (one of lm-eval's tasks, a YAML
    file's path): both, as lm-eval indexes them. lm-eval's own class is back when the call ends."""
    import lm_eval.tasks

    original = lm_eval.tasks.TaskManager

    class OwnTasksFirst(original):
        def __init__(self, verbosity=None, include_path=None, include_defaults: bool = True, metadata=None):
            narrow = include_defaults and include_path is not None and bool(names)
            super().__init__(verbosity, include_path, include_defaults and not narrow, metadata)
            if narrow and not all(name in self.all_tasks for name in names):
                super().__init__(verbosity, include_path, True, metadata)

    lm_eval.tasks.TaskManager = OwnTasksFirst
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = original


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: str | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    with quiet():
        return TaskManager(include_path=include_path, include_defaults=include_defaults)


def empty_document(request) -> bool:
    """A loglikelihood_rolling request of an empty document: no tokens, no windows; lm-eval's models give 0."""
    return request.request_type == "loglikelihood_rolling" and request.args[0] == ""


def request_rows(requests: Iterable) -> dict[str, list[tuple[dict, list[tuple[int, int, int]]]]]:
    """Per lm-eval task, its rows: (row, [(doc_id, idx, position in the row's choices)]). A document's
    loglikelihood requests that share a context are one row (their continuations its choices); otherwise each
    request is a row `<doc>.<idx>` (an empty document's rolling request none: `empty_document`). The same requests always give the same rows: scoring recomputes them."""
    by_doc: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for r in requests:
        by_doc[r.task_name][r.doc_id].append(r)
    out: dict[str, list] = {}
    for task, docs in by_doc.items():
        rows = out[task] = []
        for doc_id in sorted(docs):
            reqs = sorted({r.idx: r for r in docs[doc_id]}.values(), key=lambda r: r.idx)
            kind = reqs[0].request_type
            if kind == "loglikelihood" and len({r.args[0] for r in reqs}) == 1:
                rows.append(({"id": str(doc_id), "context": reqs[0].args[0], "choices": [r.args[1] for r in reqs],
                              "target": 0}, [(doc_id, r.idx, j) for j, r in enumerate(reqs)]))
                continue
            for r in reqs:
                if empty_document(r):  # lm-eval scores it 0 (no windows): no row, scoring answers it
                    continue
                rid = str(doc_id) if len(reqs) == 1 else f"{doc_id}.{r.idx}"
                if kind == "loglikelihood":
                    row = {"id": rid, "context": r.args[0], "choices": [r.args[1]], "target": 0}
                elif kind == "loglikelihood_rolling":
                    row = {"id": rid, "context": "", "choices": [r.args[0]], "target": 0}
                else:
                    row = {"id": rid, "context": r.args[0]}
                rows.append((row, [(doc_id, r.idx, 0)]))
    return out



def documents_hash(docs: Iterable) -> str:
    """A hash of lm-eval documents as a set (fields, labels, choices): the same for the documents a task's
    requests were built from (each request's `doc`) and those lm-eval's scoring reads again from the task's
    files (its logged samples' `doc`), where no file changed between the two."""
    lines = sorted({json.dumps(doc, sort_keys=True, default=repr) for doc in docs})
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def requests_hash(requests: Iterable) -> dict[str, str]:
    """Per lm-eval task, a hash of its requests' ids, types and arguments (rendered prompts, choices, generation
    arguments): where a template changed between the requests a sweep answered and those scoring builds, the
    hashes differ."""
    digests: dict = {}
    for r in sorted(requests, key=lambda r: (r.task_name, r.doc_id, r.idx)):
        digests.setdefault(r.task_name, hashlib.sha256()).update(
            json.dumps([r.doc_id, r.idx, r.request_type, r.args], sort_keys=True, default=repr).encode() + b"\n")
    return {task: digest.hexdigest()[:32] for task, digest in digests.items()}
