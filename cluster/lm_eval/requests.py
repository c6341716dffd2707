"""A spec's `lm_eval:` entries made into raysweep tasks (cluster/contracts/lm_eval_task.py): lm-eval builds the
requests, exactly as `lm_eval --model ...` would, and this module writes them as a task's rows.

1. `lm_eval_entry` checks the entry's settings, then runs lm-eval's `simple_evaluate` with `RecordingLM`, a
   model that answers nothing real and keeps every request it is asked (`run_lm_eval`, cluster/lm_eval/run.py:
   the one call, also used to score). Documents, few-shot contexts, `until` strings and
   generation arguments are lm-eval's own.
2. `request_rows` (cluster/lm_eval/run.py) turns each lm-eval task's requests into rows (the row ids are how
   scoring finds a request's answer again); they are written as JSONL under raysweep's cache, named by their
   content, and each task becomes a `TaskSpec` whose `data` is that file.
Bad input is one line before any engine starts: lm-eval not installed, an unknown task (with lm-eval's
closest names), a dataset that cannot be loaded offline, a task whose requests raysweep cannot serve.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from collections import defaultdict

from cluster.contracts.lm_eval_task import LmEvalSettings, LmEvalTask
from cluster.contracts.task_spec import NAME_RE, SamplingSpec, TaskSpec
from cluster.lm_eval.adapter import FewShotRefused, few_shots_checked
from cluster.lm_eval.quiet import quiet
from cluster.lm_eval.run import (documents_hash, import_lm_eval, request_rows, requests_hash, run_lm_eval,
                                 task_manager)
from cluster.lm_eval.scores import check_cache

GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}
# what lm-eval's models read as max_gen_toks too (lm_eval.models.utils.normalize_gen_kwargs, in its order of priority)
MAX_TOKEN_ALIASES = {"max_new_tokens", "max_tokens", "max_completion_tokens"}
# a message that starts with one of the entry's settings (or a key in one): the spec loader names it as
# tasks[i].lm_eval.<setting>
SETTING_ERROR = re.compile(rf"^({'|'.join(LmEvalSettings.__dataclass_fields__)})[:.]|^\w+: not a setting")
MAX_GEN_TOKS = 256  # lm-eval's default for a task that does not say (its HFLM and VLLM models)


PLACEHOLDERS = {"loglikelihood": (0.0, False), "loglikelihood_rolling": 0.0, "generate_until": ""}


class Recorder:
    """What an lm-eval model is asked, kept in order; each request answered with its type's placeholder."""

    def __init__(self):
        self.requests: list = []

    def __call__(self, kind: str, requests) -> list:
        self.requests.extend(requests)
        return [PLACEHOLDERS[kind]] * len(requests)


def check_names(settings: LmEvalSettings, manager) -> None:
    known = set(manager.all_tasks)
    for name in settings.tasks:
        if name not in known and not os.path.isfile(name):
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            where = f" or in include_path {settings.include_path}" if settings.include_path else ""
            raise ValueError(f"tasks: {name!r} is not an lm-eval task or group (lm-eval {_version()}{where}){hint}")


def _version() -> str:
    import lm_eval
    return lm_eval.__version__


def record(settings: LmEvalSettings, manager, chat_tokenizer=None) -> list:
    """Every request lm-eval would send a model for the entry's tasks: a model that gives `recorder` each one to
    keep and answer, rendering chat templates with `chat_tokenizer` (None: none)."""
    from cluster.lm_eval.answered import AnswersFrom

    recorder = Recorder()
    lm = AnswersFrom(recorder).templated(chat_tokenizer)
    try:
        with quiet(), few_shots_checked():
            run_lm_eval(settings, lm, manager, log_samples=False, bootstrap_iters=0, requests_only=True)
    except FewShotRefused:  # a ValueError of its own, which names the task
        raise
    except Exception as e:  # a dataset lm-eval could not load, a template that fails, lm-eval's own refusals
        raise ValueError(_failure(settings, manager, e)) from None
    return recorder.requests


# what `datasets` and huggingface_hub raise for data that is not there or not reachable offline
_DATA_ERROR_TYPES = (("datasets.exceptions", "DatasetNotFoundError"),
                     ("datasets.exceptions", "DataFilesNotFoundError"), ("datasets.data_files", "EmptyDatasetError"),
                     ("huggingface_hub.errors", "OfflineModeIsEnabled"),
                     ("huggingface_hub.errors", "LocalEntryNotFoundError"),
                     ("huggingface_hub.errors", "HfHubHTTPError"), ("requests.exceptions", "ConnectionError"))


def is_data_error(error: BaseException) -> bool:
    """Whether `error` means lm-eval could not load a dataset: a file not found, no connection, or one of the
    not-found, offline and HTTP errors of datasets, huggingface_hub and requests (lm-eval's dependencies), each
    its exact type: a subclass says something else (a ConnectionResetError from Ray, a gated model's repo)."""
    import importlib

    types: list[type] = [FileNotFoundError, ConnectionError]
    for module, name in _DATA_ERROR_TYPES:
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return type(error) in types


def failing_task(names: list[str], manager) -> str | None:
    """The task of `names` that fails to load, found by loading each alone where more than one is named."""
    if len(names) == 1:
        return names[0]
    for candidate in names:
        try:
            with quiet():
                manager.load([candidate])
        except Exception:  # noqa: BLE001  (whatever it raises: this is the one)
            return candidate
    return None


def _failure(settings: LmEvalSettings, manager, error: Exception) -> str:
    """One line: the task that fails (`failing_task`) and why."""
    first = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else '(no message)'}"
    if isinstance(error, AssertionError) and settings.samples:  # lm-eval's check of each index against the documents
        said = str(error).strip().splitlines()[0][:300] if str(error).strip() else first
        return f"samples: task {next(iter(settings.samples))}: {said}" if len(settings.samples) == 1 else \
            f"samples: {said}"
    name = failing_task(list(settings.tasks), manager)
    where = f"tasks: {name!r}: " if name else ""
    if is_data_error(error):
        return f"{where}{data_failure(error)}"
    return f"{where}lm-eval could not build the requests: {first[:400]}"


def data_failure(error: Exception) -> str:
    """The line for a dataset lm-eval could not load (is_data_error), with what to do offline."""
    first = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else '(no message)'}"
    return (f"lm-eval could not load the dataset ({first[:300]}). raysweep reads data offline: give the task local "
            "files (dataset_path: json, dataset_kwargs: {data_files: ...}), or put the dataset in the Hugging Face "
            "cache and set HF_DATASETS_OFFLINE=1 (HF_DATASETS_CACHE names the cache)")


def sampling_of(task: str, requests: list) -> SamplingSpec:
    """A generate_until task's sampling from its generation arguments (the same for every request), as
    lm-eval's HF and vLLM models read them."""
    kwargs = {json.dumps(r.args[1], sort_keys=True, default=str) for r in requests}
    if len(kwargs) > 1:
        raise ValueError(f"{task}: its documents ask for different generation arguments; raysweep runs one "
                         "sampling per task")
    from lm_eval.models.utils import normalize_gen_kwargs

    given = dict(requests[0].args[1])
    unknown = sorted(set(given) - GEN_KEYS - MAX_TOKEN_ALIASES - {"num_beams"})
    if unknown:
        raise ValueError(f"{task}: generation argument {unknown[0]!r} is not one raysweep passes to its engines "
                         f"(it takes {', '.join(sorted(GEN_KEYS | MAX_TOKEN_ALIASES | {'num_beams'}))})")
    if given.get("num_beams", 1) != 1:  # vLLM 0.26's SamplingParams has no beam search: lm-eval's vLLM model fails
        raise ValueError(f"{task}: generation argument num_beams: {given['num_beams']!r}: beam search is not one "
                         "raysweep's engines run (num_beams: 1 is)")
    for key in sorted(set(given) & (MAX_TOKEN_ALIASES | {"max_gen_toks", "temperature", "top_p", "top_k"})):
        _check_number(task, key, given[key])
    gen = normalize_gen_kwargs(given, default_max_gen_toks=MAX_GEN_TOKS)  # lm-eval's aliases and their order
    until = gen.get("until") or ()
    do_sample = gen.get("do_sample")
    temperature = 0.0 if do_sample is False else float(gen.get("temperature", 1.0 if do_sample else 0.0))
    repeats = max(r.repeats for r in requests)
    try:
        return _sampling_spec(gen, until, temperature, repeats)
    except ValueError as e:  # SamplingSpec's own check, named as the task's generation arguments
        raise ValueError(f"{task}: generation arguments: {e}") from None


def _check_number(task: str, key: str, value) -> None:
    """A numeric generation argument: a number, text of one (lm-eval's --gen_kwargs are text), or None."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if value is not None and (isinstance(number, bool) or not isinstance(number, (int, float)) or number != number):
        raise ValueError(f"{task}: generation argument {key}: must be a number, got {value!r}")


def _sampling_spec(gen: dict, until, temperature: float, repeats: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=int(gen.get("max_gen_toks", MAX_GEN_TOKS)), temperature=temperature,
                        top_p=float(gen.get("top_p", 1.0)), top_k=int(gen.get("top_k", 0) or 0),
                        stop=tuple([until] if isinstance(until, str) else until),
                        n=repeats if temperature > 0 else 1)


def lm_eval_entry(raw: dict, base_dir: str, entry: int, get_chat_tokenizer=lambda: None,
                  models: tuple[str, ...] = ()) -> list[TaskSpec]:
    """The raysweep tasks of one `lm_eval:` entry (its settings as the spec gives them) over the sweep's `models`
    (their names)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a mapping of settings (tasks, include_path, num_fewshot ...), got {raw!r}")
    known = set(LmEvalSettings.__dataclass_fields__)
    extra = sorted(set(raw) - known)
    if extra:
        close = difflib.get_close_matches(extra[0], sorted(known), n=1)
        raise ValueError(f"{extra[0]}: not a setting{f' (did you mean {close[0]!r}?)' if close else ''}")
    settings = LmEvalSettings(**_paths_resolved(dict(raw), base_dir))
    if settings.use_cache is not None and len(models) > 1 and "{model}" not in settings.use_cache:
        raise ValueError(f"use_cache: lm-eval's cache holds one model's answers, and the sweep has {len(models)} "
                         "models: put {model} in the path (each model's own file)")
    if settings.use_cache is not None:
        for name in models or (None,):
            check_cache(settings.use_cache if name is None else settings.cache_of(name))
    import_lm_eval()
    manager = task_manager(settings)
    check_names(settings, manager)
    requests = record(settings, manager, get_chat_tokenizer() if settings.apply_chat_template else None)
    by_task: dict[str, list] = defaultdict(list)
    for r in requests:
        by_task[r.task_name].append(r)
    unknown = sorted(set(settings.samples or {}) - set(by_task))
    if unknown:  # lm-eval would run every document of the task meant
        raise ValueError(f"samples: {unknown[0]!r} is not one of the entry's lm-eval tasks ({', '.join(by_task)})")
    rows, hashes = request_rows(requests), requests_hash(requests)
    return [task_spec(name, reqs, rows.get(name, []), settings, entry, hashes[name]) for name, reqs in by_task.items()]


def _paths_resolved(settings: dict, base_dir: str) -> dict:
    """The entry's paths from the spec's folder where relative (include_path, use_cache), and `samples` given as
    a JSON file's path read into its mapping."""
    for key in ("include_path", "use_cache", "samples"):
        if isinstance(settings.get(key), str) and settings[key].strip():
            path = os.path.expanduser(settings[key])
            settings[key] = path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))
    if settings.get("include_path") is not None and not os.path.isdir(settings["include_path"]):
        raise ValueError(f"include_path: {settings['include_path']} is not a folder")
    if isinstance(settings.get("samples"), str):
        try:
            with open(settings["samples"], encoding="utf-8") as f:
                settings["samples"] = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"samples: {settings['samples']} is not a JSON file of document indices per task "
                             f"({type(e).__name__}: {e})") from None
    return settings


def task_spec(name: str, requests: list, rows: list, settings: LmEvalSettings, entry: int,
              requests_digest: str | None = None) -> TaskSpec:
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"{name}: an lm-eval task name raysweep cannot use as a task name (letters, digits, '.', "
                         "'_' or '-')")
    kinds = sorted({r.request_type for r in requests})
    if len(kinds) > 1:
        raise ValueError(f"{name}: its documents make requests of several types ({', '.join(kinds)}); raysweep "
                         "serves a task of one type")
    kind = "multiple_choice" if kinds[0] == "loglikelihood" and any(len(row["choices"]) > 1 for row, _ in rows) \
        else kinds[0]
    if not rows:
        raise ValueError(f"{name}: every document is empty: nothing to run")
    ref = LmEvalTask(task=name, output_type=kind, settings=settings, entry=entry,
                     documents=documents_hash(r.doc for r in requests), requests=requests_digest)
    path = _write_rows(name, [row for row, _ in rows])
    if kinds[0] == "generate_until":
        return TaskSpec(name=name, data=path, prompt="{context}", id_column="id", lm_eval=ref,
                        sampling=sampling_of(name, requests), length_policy="truncate_left")
    # lm-eval's continuations hold their delimiter; a context too long is cut from the left, as lm-eval's models
    # cut it (rolling rows are windows: never too long)
    return TaskSpec(name=name, data=path, prompt="{context}", id_column="id", lm_eval=ref, type="loglikelihood",
                    choices="choices", target="target", target_delimiter="",
                    length_policy="error" if kind == "loglikelihood_rolling" else "truncate_left")


def _write_rows(name: str, rows: list[dict]) -> str:
    """The rows as JSONL under raysweep's cache, named by their content (the same requests: the same file)."""
    from cluster.contracts.model_paths import cache_root

    body = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows).encode()
    folder = cache_root() / "lm_eval"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{hashlib.sha256(body).hexdigest()[:16]}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(body)
        os.replace(tmp, path)
    return str(path)

