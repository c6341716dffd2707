"""lm-eval as raysweep calls it (docs/lm-eval.md): the one `simple_evaluate` call that both builds a `lm_eval:`
entry's requests (cluster/lm_eval/requests.py) and scores its results (cluster/lm_eval/scores.py),
and `request_rows`, the rule that makes requests into a task's rows, which scoring applies again to find each
request's answer. lm-eval is imported only inside these functions: it is an optional extra.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import sys
import threading
from collections import defaultdict
from typing import Iterable

from cluster.contracts.lm_eval_task import EXTRA, LmEvalSettings
from cluster.lm_eval.adapter import (request_cache_owned, require_version, run_record_ahead, templates_compiled_once,
                                     without_run_record)
from cluster.lm_eval.quiet import quiet


def import_lm_eval():
    """lm-eval, imported: one line where it is not installed, or is another release than raysweep's (adapter.py).
    Where the hub cannot be reached, `datasets` and the hub's client are made offline first (they read the switch
    as they are imported): a dataset not in the cache is then one line at once, not after a minute of retries."""
    from cluster.contracts.hub import offline_where_unreachable

    require_version()
    if "datasets" not in sys.modules:
        offline_where_unreachable()
    try:
        import lm_eval.evaluator  # noqa: F401
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        raise ValueError(f"lm-eval is not installed ({e}); {EXTRA}") from None
    import lm_eval
    return lm_eval


def run_lm_eval(settings: LmEvalSettings, lm, task_manager, log_samples: bool, bootstrap_iters: int,
                tracker=None, requests_only: bool = False) -> dict:
    """lm-eval's `simple_evaluate` with the entry's settings: the one call that builds and that scores. Without a
    `limit` or `samples`, lm-eval's request cache is on where a run holds it in a folder of its own
    (jobs/lifecycle.py, adapter.py `own_request_cache`): the scoring pass reads the requests the building pass made
    (lm-eval renders each document's few-shot context again otherwise, about half of a pass), and no other run can
    read a cache made from other data (its key names neither the limit nor the samples); off elsewhere.
    `requests_only` (the building pass, whose results are thrown away): without what only the results record
    (`without_run_record`), without seeding torch (a model's sampling; no request depends on it): torch is not
    imported for it; and without predict_only (which changes only the metrics). The scoring pass loads each dataset
    again without `datasets`' download count, and takes lm-eval's environment record on a thread while it scores
    (adapter.py). The answers cache (`use_cache`) is the scoring model's own (cluster/lm_eval/scores.py)."""
    import lm_eval.evaluator

    random_seed, numpy_seed, torch_seed, fewshot_seed = settings.seeds
    if not requests_only:
        # torch imported whole before lm-eval seeds it and before its environment record's thread imports it: two
        # threads importing torch at once left it half initialised for one (a complete resume's scoring pass)
        score_ahead()
        _AHEAD["thread"].join()
    passes = (without_run_record(),) if requests_only else (downloads_not_counted_again(), run_record_ahead())
    with contextlib.ExitStack() as patched:
        for patch in (templates_compiled_once(), *passes):
            patched.enter_context(patch)
        return lm_eval.evaluator.simple_evaluate(
            # with a limit lm-eval's request cache would build every document; its key names no samples
            cache_requests=settings.limit is None and settings.samples is None and request_cache_owned(),
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
    """While a sweep's shards run, once per process: torch imported on a daemon thread. lm-eval's scoring pass seeds
    torch first (`set_torch_seed`); on the 2-core CPU machine torch's import was 2.8 s of a 4.7 s scoring pass after
    the last result (300 + 300 documents, builtin:tiny). The scoring pass waits for the thread (`run_lm_eval`, which
    starts it where no sweep's shards did). lm-eval's environment record stays in the scoring pass, inside `quiet()`
    and after the engines have closed: torch's collect_env initialises CUDA and prints what it warns of."""
    def take() -> None:
        try:
            import torch  # noqa: F401
        except Exception:  # noqa: BLE001 - the scoring pass imports it again, and says what fails
            pass

    if _AHEAD["thread"] is None:
        _AHEAD["thread"] = threading.Thread(target=take, name="raysweep-score-ahead", daemon=True)
        _AHEAD["thread"].start()


def task_manager(settings: LmEvalSettings):
    """lm-eval's index of task YAMLs, built once per folder in a process, for building requests and for
    scoring them. Where the include_path holds every task named, only it is indexed (lm-eval's own tasks
    are some 14,000 files, 6-9 s to read); otherwise lm-eval's tasks too, as its command line does."""
    if settings.include_path is not None:
        own = _task_manager(settings.include_path, False)
        if all(name in own.all_tasks for name in settings.tasks):
            return own
    return _task_manager(settings.include_path, True)


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
    request is a row `<doc>.<idx>` (an empty document's rolling request none: `empty_document`). The same
    requests always give the same rows: scoring recomputes them."""
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


@contextlib.contextmanager
def downloads_not_counted_again():
    """The `datasets` library without its download count: each `load_dataset` of a task's documents otherwise sends
    the Hugging Face hub a HEAD request (`datasets.load.increase_load_count`, unless HF_HUB_OFFLINE is set). For
    lm-eval's scoring pass, which loads every dataset the building pass loaded already: on a machine that cannot
    reach the hub the request waits for its name lookup, 5.6 s at the end of a sweep of lm-eval's suite on the 2-core
    CPU machine. `datasets.config.HF_UPDATE_DOWNLOAD_COUNTS` is read at each load; it is back when the call ends."""
    import datasets.config as config

    saved = config.HF_UPDATE_DOWNLOAD_COUNTS
    config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        config.HF_UPDATE_DOWNLOAD_COUNTS = saved
