"""lm-eval's scores of a sweep's `lm_eval:` tasks, by lm-eval's own code, once their rows are committed.

Per `lm_eval:` entry and model: `ReplayLM` is an lm-eval model that answers each request from the committed
results rows (found again through `request_rows`, cluster/lm_eval/run.py), and `run_lm_eval` runs
lm-eval's `simple_evaluate` with it and the entry's settings, so filters, `process_results`, aggregation,
groups and stderr are lm-eval's. Written under the output, per model (docs/lm-eval.md):
- `lm_eval/<model>/results_<date>.json` and `samples_<task>_<date>.jsonl`: lm-eval's results and its
  `--log_samples` records, written by lm-eval's EvaluationTracker as `lm_eval --output_path` writes them;
- `lm_eval/<model>/samples_<task>.parquet`: one row per document and filter (doc_id, filter, target,
  arguments, resps, filtered_resps as JSON, each metric a column);
and each task's summary row gets lm-eval's metrics with their stderr, and each group a row of its own with
lm-eval's aggregate (`merge_summary`).
A model whose rows are not all in (a failed shard) is left out, and the run says so. A task whose own code raises
while scored (its process_results) is left out of its entry's scoring, its summary row carrying the error
(cluster/lm_eval/failures.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from collections import defaultdict
from contextlib import closing
from pathlib import Path
from typing import Callable
from urllib.request import pathname2url

import pyarrow as pa

from cluster.contracts.shard import GENERATED
from cluster.contracts.spec import ModelSpec, SweepSpec
from cluster.lm_eval.failures import scored_leaving_out_failures
from cluster.lm_eval.quiet import quiet
from cluster.lm_eval.run import (documents_hash, empty_document, request_rows, requests_hash, run_lm_eval,
                                 task_manager)

COUNTS = ("n", "n_samples", "n_ok", "n_truncated", "n_skipped", "n_error", "output_tokens")  # summary columns a group sums
BYPASS = "bypass"  # the metric lm-eval's predict_only puts in place of a task's metrics (its aggregate is 999)
ANSWER_COLUMNS = ("sample_id", "completion", "status", "error", "output_text", "choice_logprobs", "choice_greedy")


class MissingAnswer(Exception):
    """A request whose row is not committed, or is an error or skipped row: lm-eval cannot score its task."""


class ChangedDocuments(MissingAnswer):
    """A task's documents or requests, built again to score it, are not those its answers were made for."""


def replay_lm(answers: dict[str, dict[tuple[str, int], dict]], planned: dict[str, str | None] | None = None,
              manager=None, cache: str | None = None):
    """An lm-eval model answering from results rows: `answers[task][(sample_id, completion)]` = row. Where
    `planned[task]` holds the hash of the task's requests as planned (requests_hash), requests built otherwise
    (its template changed since) raise ChangedDocuments before any is answered. `cache`: lm-eval's answers cache
    (`--use_cache`'s path) in front of the rows, lm-eval's own CachingLM: a request it holds is answered from it,
    the others from the rows and added to it. The rows are found from every request lm-eval asks for, before the
    cache takes those it holds (the rule that makes requests into rows reads a document's requests together)."""
    from cluster.lm_eval.answered import AnswersFrom

    return AnswersFrom(Replay(answers, planned or {}, manager, cache))


class Replay:
    """`replay_lm`'s answers to one request type's requests."""

    def __init__(self, answers: dict, planned: dict, manager, cache: str | None):
        self.answers, self.planned, self.manager, self.cache = answers, planned, manager, cache

    def __call__(self, kind: str, requests) -> list:
        for task, now in requests_hash(requests).items():
            if self.planned.get(task) not in (None, now):
                raise ChangedDocuments(_changed(task, "prompts", self.manager))
        where = {}
        for task, rows in request_rows(requests).items():
            for row, keys in rows:
                for doc_id, idx, position in keys:
                    where[(task, doc_id, idx)] = (row["id"], position)
        if self.cache is None:
            return getattr(FromRows(self.answers, where), kind)(requests)
        from lm_eval.api.model import CachingLM

        cached = CachingLM(FromRows(self.answers, where), cache_file(self.cache))
        try:
            return getattr(cached, kind)(requests)
        finally:
            cached.dbdict.close()  # its connection's thread, which lm-eval leaves open


class FromRows:
    """The three request types of an lm-eval model (what lm-eval's CachingLM calls), each request answered from its
    row: `where[(task, doc_id, idx)]` = (row id, the request's position in the row's choices)."""

    def __init__(self, answers: dict[str, dict[tuple[str, int], dict]], where: dict[tuple, tuple[str, int]]):
        self.answers, self.where = answers, where
        self.cache_hook = None

    def set_cache_hook(self, cache_hook) -> None:
        """As lm-eval's `LM` keeps it: CachingLM gives it, and writes what the rows answer itself."""
        self.cache_hook = cache_hook

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return [(row["choice_logprobs"][p], bool(row["choice_greedy"][p])) for row, p in self._rows(requests)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return [row["choice_logprobs"][0] for row, _ in self._rows(requests)]

    def generate_until(self, requests, disable_tqdm: bool = False):
        return [row["output_text"] for row, _ in self._rows(requests)]

    def _rows(self, requests):
        seen: dict[tuple, int] = defaultdict(int)
        for r in requests:
            if empty_document(r):
                yield {"choice_logprobs": [sum(())]}, 0  # no windows: lm-eval's models sum nothing (the int 0)
                continue
            key = (r.task_name, r.doc_id, r.idx)
            sample_id, position = self.where[key]
            completion = seen[key]
            seen[key] += 1
            found = self.answers.get(r.task_name, {})
            row = found.get((sample_id, completion)) or found.get((sample_id, 0))  # greedy repeats: the one completion
            if row is None or row["status"] not in GENERATED:
                why = "no committed row" if row is None else f"a {row['status']} row ({row.get('error')})"
                raise MissingAnswer(f"task {r.task_name}: document {r.doc_id} has {why}")
            yield row, position


def cache_file(path: str) -> str:
    """The sqlite file of lm-eval's answers cache at `--use_cache PATH`, as lm-eval's simple_evaluate names it for
    its one process (rank 0)."""
    return f"{path}_rank0.db"


def check_cache(path: str) -> None:
    """What lm-eval's CachingLM would fail on after every sample ran, said when the spec is loaded (ValueError,
    one line): `path`'s folder must be one or creatable (lm-eval makes it), and an existing cache file a regular
    file sqlite opens."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # lm-eval creates what is missing; the nearest that exists must be a folder
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"use_cache: {path}: {folder} is not a folder, so lm-eval cannot make its cache there")
    db = cache_file(path)
    if not os.path.exists(db):
        return
    if not os.path.isfile(db):
        raise ValueError(f"use_cache: {db} is not a regular file, so not lm-eval's sqlite cache")
    try:
        with closing(sqlite3.connect(f"file:{pathname2url(db)}?mode=ro", uri=True)) as con:
            con.execute("PRAGMA schema_version")
    except sqlite3.Error as e:
        raise ValueError(f"use_cache: {db} is not an sqlite cache lm-eval can use ({e})") from None


def _changed(task: str, what: str, manager) -> str:
    """The line for a task whose `what` (documents, prompts) changed between planning and scoring, naming its
    YAML file (from lm-eval's task index) where known."""
    entry = getattr(manager, "task_index", {}).get(task) if manager is not None else None
    path = getattr(entry, "yaml_path", None)
    return (f"task {task}: its {what} changed since the sweep planned them{f' ({path})' if path else ''}; no score "
            "is made from answers to other documents: run the sweep again with --new-run to answer these")


def check_documents(results: dict, tasks: list, manager) -> None:
    """The documents lm-eval's scoring read (its logged samples) against those the sweep planned: the request
    cache gives scoring the planned requests, but lm-eval reads each document again from its files to score it."""
    for task in tasks:
        samples = results.get("samples", {}).get(task.name)
        if task.lm_eval.documents is not None and samples is not None and \
                documents_hash(s["doc"] for s in samples) != task.lm_eval.documents:
            raise ChangedDocuments(_changed(task.name, "documents", manager))


ModelFiles = Callable[[ModelSpec], tuple[Callable | None, int | None]]  # its tokenizer's loader, its length


def score_lm_eval(spec: SweepSpec, read: Callable[[str, str], pa.Table | None], write_text: Callable[[str, str], None],
                  write_table: Callable[[str, pa.Table], None], log: Callable[[str], None],
                  chat_tokenizer: Callable[[], object] = lambda: None, model_files: ModelFiles = lambda m: (None, None)
                  ) -> dict[tuple[str, str], dict]:
    """lm-eval's results for each model x `lm_eval:` entry whose rows are all committed; `read(model, task)`
    gives a task's committed rows (None while a shard is missing); `chat_tokenizer()` the tokenizer whose chat
    template built the requests of an entry that applies one; `model_files(model)` the model's tokenizer's loader
    and length (lm-eval's results record them: answered.py described). Returns {(model, task): lm-eval's metrics}."""
    from lm_eval.loggers import EvaluationTracker

    entries: dict[int, list] = defaultdict(list)
    for task in spec.tasks:
        if task.lm_eval is not None and task.lm_eval.entry >= 0:  # < 0: `raysweep lm-eval`, lm-eval scores them
            entries[task.lm_eval.entry].append(task)
    metrics: dict[tuple[str, str], dict] = {}
    for tasks in entries.values():
        settings = tasks[0].lm_eval.settings
        manager = None
        for model in spec.models:
            answers = {}
            for task in tasks:
                table = read(model.name, task.name)
                if table is None:
                    break
                answers[task.name] = {(r["sample_id"], r["completion"]): r for r in table.select(ANSWER_COLUMNS).to_pylist()}
            else:
                said: list[str] = []  # said after quiet(): inside it, what is printed goes to lm-eval's logger
                with quiet():
                    manager = manager or task_manager(settings)
                    trackers = []

                    def score(chosen):
                        trackers.append(EvaluationTracker())
                        return run_lm_eval(chosen, lm, manager, log_samples=True,
                                           bootstrap_iters=settings.bootstrap_iters, tracker=trackers[-1])
                    try:
                        planned = {t.name: t.lm_eval.requests for t in tasks}
                        cache = settings.cache_of(model.name)
                        replay = replay_lm(answers, planned, manager, cache).described(*model_files(model))
                        lm = replay.templated(chat_tokenizer() if settings.apply_chat_template else None)
                        results, failed = scored_leaving_out_failures(score, settings, [t.name for t in tasks])
                        if results is not None:
                            results["config"]["use_cache"] = cache  # as `--use_cache` records it
                        check_documents(results or {}, tasks, manager)
                    except MissingAnswer as e:  # every task of the entry unscored: their summary rows say so, exit 1
                        said.append(f"[raysweep] lm-eval results of model {model.name} not written: {e}")
                        results, failed = None, {}
                        metrics.update({(model.name, t.name): {"error": f"lm-eval results not written: {e}"}
                                        for t in tasks})
                    for task_name, why in failed.items():  # the summary row carries it; the run exits 1
                        said.append(f"[raysweep] {why} (model {model.name}): not scored; its rows stay committed, "
                                    "and the same command scores them once the task is fixed")
                        metrics[(model.name, task_name)] = {"error": why}
                    if results is not None:
                        metrics.update(_write(model, spec.model_path(model), results, trackers[-1], write_text, write_table))
                for line in said:
                    log(line)
                continue
            log(f"[raysweep] lm-eval results of model {model.name} not written: task {task.name} is not complete")
    return metrics


def model_args(path: str, engine: dict) -> dict:
    """What lm-eval's results record as `model_args` for a spec's model, as lm-eval records `raysweep lm-eval
    --model_args` (a mapping): its checkpoint (`pretrained`, the path the spec's model resolves to) and its
    engine's settings (the spec's `engine:`, less the backend)."""
    return {"pretrained": path, **{k: v for k, v in sorted(engine.items()) if k != "backend"}}


def _write(spec_model: ModelSpec, path: str, results: dict, tracker, write_text, write_table
           ) -> dict[tuple[str, str], dict]:
    """lm-eval's own files, written by its EvaluationTracker into a local folder and copied into the output
    (which may be a remote filesystem): results_<date>.json and samples_<task>_<date>.jsonl, as
    `lm_eval --output_path ... --log_samples` names them; beside them each task's samples as Parquet. `path`:
    where the model resolves to, for its `model_args`."""
    from lm_eval.utils import handle_non_serializable

    model = spec_model.name
    samples = results.pop("samples", {})
    results["config"]["model"] = "raysweep"
    results["config"]["model_args"] = model_args(path, spec_model.engine)

    def dumps(value) -> str:
        return json.dumps(value, default=handle_non_serializable, ensure_ascii=False)

    for task, records in samples.items():
        write_table(f"lm_eval/{model}/samples_{task}.parquet", samples_table(records, dumps))
    documents = {task: n.get("effective") for task, n in results.get("n-samples", {}).items()}
    metrics = {(model, task): {**values, "documents": documents.get(task)}
               for task, values in results["results"].items() if task in samples}
    for group, subtasks in results.get("group_subtasks", {}).items():  # a group's own row: lm-eval's aggregate
        if subtasks and group in results.get("groups", {}):
            metrics[(model, group)] = {**results["groups"][group], "subtasks": list(subtasks),
                                       "documents": sum(documents.get(t) or 0 for t in subtasks if t in documents)}
    with tempfile.TemporaryDirectory(prefix="raysweep-lm-eval-") as folder:
        tracker.output_path = folder
        tracker.general_config_tracker.model_name = tracker.general_config_tracker.model_name_sanitized = model
        tracker.save_results_aggregated(results=results, samples=samples)
        for task, records in samples.items():
            tracker.save_results_samples(task_name=task, samples=records)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                write_text(f"lm_eval/{model}/{path.name}", path.read_text(encoding="utf-8"))
    return metrics


def samples_table(records: list[dict], dumps) -> pa.Table:
    """lm-eval's per-document records as a table: each metric a column (float where every value is a number,
    else its JSON, as lm-eval's perplexity metrics keep (log-likelihood, length) pairs)."""
    names = list(dict.fromkeys(m for r in records for m in r["metrics"]))
    columns = {
        "doc_id": pa.array([r["doc_id"] for r in records], pa.int64()),
        "filter": pa.array([r["filter"] for r in records], pa.string()),
        "target": pa.array([dumps(r["target"]) if not isinstance(r["target"], str) else r["target"]
                            for r in records], pa.string()),
        **{k: pa.array([dumps(r[k]) for r in records], pa.string())
           for k in ("arguments", "resps", "filtered_resps")},
    }
    for name in names:
        values = [r.get(name) for r in records]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) or v is None for v in values)
        columns[name] = pa.array([float(v) if v is not None else None for v in values] if numeric
                                 else [dumps(v) for v in values], pa.float64() if numeric else pa.string())
    return pa.table(columns)


def summary_metrics(values: dict) -> tuple[float | None, float | None, list[dict]]:
    """lm-eval's `results[task]` as the summary keeps it: the first metric as score and stderr, and every
    metric,filter pair with its stderr (lm-eval's "N/A" stderr: null). `predict_only`'s stand-in metric, whose
    999 measures nothing, is left out: such a task has no score."""
    out = []
    for key, value in values.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, _, filt = key.partition(",")
        if metric == BYPASS:
            continue
        stderr = values.get(f"{metric}_stderr,{filt}")
        out.append({"name": metric if filt == "none" else key, "value": float(value),
                    "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": None})
    first = out[0] if out else {"value": None, "stderr": None}
    return first["value"], first["stderr"], out


def merge_summary(summary: pa.Table, metrics: dict[tuple[str, str], dict]) -> pa.Table:
    """The summary with lm-eval's metrics on its lm-eval tasks' rows."""
    if not metrics:
        return summary
    rows = summary.to_pylist()
    listed = {(row["model"], row["task"]): row for row in rows}
    for (model, task), values in metrics.items():  # a group: counts summed over its tasks' rows
        if "subtasks" in values and (model, task) not in listed:
            parts = [listed[(model, t)] for t in values["subtasks"] if (model, t) in listed]
            rows.append({"model": model, "task": task, **{k: sum(p[k] or 0 for p in parts) for k in COUNTS}})
    for row in rows:
        values = metrics.get((row["model"], row["task"]))
        if values is not None and "error" in values:  # its scoring failed: no score, the error
            row.update(score=None, stderr=None, metrics=[], n_scored=None, error=values["error"])
        elif values is not None:
            row["score"], row["stderr"], row["metrics"] = summary_metrics(values)
            row["n_scored"] = values.get("documents")
            for m in row["metrics"]:
                m["n"] = values.get("documents")
    return pa.Table.from_pylist(sorted(rows, key=lambda r: (r["model"], r["task"])), schema=summary.schema)


def scored_summary(spec: SweepSpec, sink, summary: pa.Table, log: Callable[[str], None],
                   chat_tokenizer: Callable[[], object] = lambda: None,
                   model_files: ModelFiles = lambda m: (None, None)) -> pa.Table:
    """`summary` with lm-eval's metrics of the sweep's `lm_eval:` tasks whose rows are all committed, their
    files written under the output (`sink`: cluster/store/sink.py, read and written through). Called by the run
    once its shards are done, before the summary is written."""
    metrics = score_lm_eval(spec, lambda model, task: sink.committed_rows(model, task, list(ANSWER_COLUMNS)),
                            sink.write_text, sink.write_parquet, log, chat_tokenizer, model_files)
    return merge_summary(summary, metrics)
