"""Reading a sweep spec file: strict YAML (a key given twice is an error, with its line; unknown keys are
refused with the known one they are closest to), every value checked by the spec's dataclasses
(cluster/contracts/spec.py), every problem one `SpecError` naming the file and the field path."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import yaml

from cluster.contracts.spec import ActorSpec, ModelSpec, ShardLimits, SpecError, SweepSpec
from cluster.contracts.task_spec import STRUCTURED_KINDS, ReplaySpec, SamplingSpec, ScorerSpec, StructuredSpec, TaskSpec, _suggest
from cluster.inputs.data_files import file_problem

_SURROGATE = re.compile("[\ud800-\udfff]")  # a code point of a UTF-16 pair: alone, not text
MAX_DEPTH = 100  # nesting levels in a spec, at most
MAX_VALUES = 1_000_000  # values in a spec with every YAML alias expanded, at most


class _Fields:
    """Reads one YAML mapping, tracking the field path. Its keys are checked against the known ones
    first, so a misspelt key is reported as itself (`unknown field 'promt' (did you mean 'prompt'?)`),
    not as the required field it leaves missing. `nested`: keys that belong in a sub-section."""

    def __init__(self, raw: Any, path: str, known: list[str], nested: dict[str, list[str]] | None = None):
        if not isinstance(raw, dict):
            raise ValueError(f"{path or 'spec'}: must be a mapping, got {type(raw).__name__}")
        self.raw, self.path = dict(raw), path
        for key in self.raw:
            if key not in known:
                home = next((section for section, keys in (nested or {}).items() if key in keys), None)
                hint = f" (it belongs under `{home}`)" if home else _suggest(str(key), known)
                raise ValueError(f"{self.at(str(key))}: unknown field {str(key)!r}{hint}")

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def pop(self, key: str, default: Any = None) -> Any:
        return self.raw.pop(key, default)


def _names(cls: type, *leave_out: str) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in leave_out]


def _build(cls: type, where: str, **kwargs: Any) -> Any:
    """Construct a dataclass, prefixing its ValueError with the field path `where`."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field left out, or a wrong argument type reaching the constructor
        missing = re.search(r"missing \d+ required .*?'(\w+)'", str(e))
        if missing:
            raise ValueError(f"{where + '.' if where else ''}{missing.group(1)}: required") from None
        raise ValueError(f"{where or 'spec'}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}.{e}" if where else str(e)) from None


def _sampling(raw: Any, path: str) -> SamplingSpec:
    keys = _names(SamplingSpec)
    f = _Fields(raw or {}, path, keys)
    return _build(SamplingSpec, path, **{k: f.pop(k) for k in keys})


def _structured(raw: Any, path: str) -> StructuredSpec | None:
    if raw is None:
        return None
    f = _Fields(raw, path, list(STRUCTURED_KINDS))
    if len(f.raw) != 1:
        raise ValueError(f"{path}: give exactly one of {', '.join(STRUCTURED_KINDS)}")
    kind, value = next(iter(f.raw.items()))
    return _build(StructuredSpec, path, kind=kind, value=value)


def _scorer(raw: Any, path: str) -> ScorerSpec | None:
    if raw is None or isinstance(raw, str):
        return _build(ScorerSpec, path, name=raw) if raw else None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a scorer name or a mapping with `name`, got {type(raw).__name__}")
    args = dict(raw)
    name = args.pop("name", None)
    return _build(ScorerSpec, path, name=name, args=args)


def _task(raw: Any, path: str) -> TaskSpec:
    f = _Fields(raw, path, _names(TaskSpec), nested={"sampling": _names(SamplingSpec)})
    return _build(
        TaskSpec, path,
        name=f.pop("name"), data=f.pop("data"), prompt=f.pop("prompt"), messages=f.pop("messages"),
        chat=f.pop("chat"), system=f.pop("system"), target=f.pop("target"), id_column=f.pop("id_column"),
        sampling=_sampling(f.pop("sampling"), f.at("sampling")),
        structured=_structured(f.pop("structured"), f.at("structured")),
        scorer=_scorer(f.pop("scorer"), f.at("scorer")),
        length_policy=f.pop("length_policy"), fail_on_error=f.pop("fail_on_error"),
        chunked_prefill=_on_off(f.pop("chunked_prefill")), type=f.pop("type"), choices=f.pop("choices"),
        target_delimiter=f.pop("target_delimiter"),
        pass_at=f.pop("pass_at"), replay=_replay(f.pop("replay"), f.at("replay")),
    )


def _replay(raw: Any, path: str) -> ReplaySpec | None:
    if raw is None:
        return None
    f = _Fields(raw, path, _names(ReplaySpec))
    return _build(ReplaySpec, path, **{k: f.pop(k) for k in _names(ReplaySpec)})


def _on_off(value: Any) -> Any:
    """YAML 1.1 reads a bare on/off as a boolean; `chunked_prefill: off` means the string."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


def _model(raw: Any, path: str) -> ModelSpec:
    f = _Fields(raw, path, ["name", "path", "engine"], nested={"engine": ["backend", "max_model_len"]})
    engine = f.pop("engine") or {}
    if isinstance(engine, str):  # `engine: vllm` forces a backend with default engine arguments
        engine = {"backend": engine}
    if not isinstance(engine, dict):
        raise ValueError(f"{f.at('engine')}: must be a backend name or a mapping of engine arguments")
    engine = dict(engine)
    return _build(ModelSpec, path, name=f.pop("name"), path=f.pop("path"),
                  backend=engine.pop("backend", None), engine=engine)


def _or(value: Any, default: Any) -> Any:
    """`value` unless the key was left out (or null): `output: 0` or `output: ""` is refused, not replaced."""
    return default if value is None else value


def _listed(raw: Any, key: str, build) -> tuple:
    if not isinstance(raw, list):
        raise ValueError(f"{key}: must be a list")
    return tuple(build(item, f"{key}[{i}]") for i, item in enumerate(raw))


def _tasks(raw: Any, models: tuple[ModelSpec, ...], base_dir: str) -> tuple[TaskSpec, ...]:
    """The spec's tasks: its own, and those a `lm_eval:` entry names (cluster/lm_eval/requests.py)."""
    if not isinstance(raw, list):
        raise ValueError("tasks: must be a list")
    tasks, entries = [], 0
    for i, item in enumerate(raw):
        if not (isinstance(item, dict) and "lm_eval" in item):
            tasks.append(_task(item, f"tasks[{i}]"))
            continue
        extra = sorted(set(item) - {"lm_eval"})
        if extra:
            raise ValueError(f"tasks[{i}].{extra[0]}: an lm_eval entry holds only `lm_eval:` (its tasks are named "
                             "by lm-eval)")
        from cluster.inputs.model_files import chat_tokenizer
        from cluster.lm_eval.requests import SETTING_ERROR, lm_eval_entry

        try:
            tasks.extend(lm_eval_entry(item["lm_eval"], base_dir, entries, lambda: chat_tokenizer(models, base_dir),
                                       tuple(m.name for m in models)))
        except ValueError as e:
            sep = "." if SETTING_ERROR.match(str(e)) else ": "
            raise ValueError(f"tasks[{i}].lm_eval{sep}{e}") from None
        entries += 1
    return tuple(tasks)


def parse_spec(raw: Any, source: str = "<spec>", base_dir: str = ".") -> SweepSpec:
    """Validate a parsed YAML document; errors are SpecError naming `source` and the field."""
    try:
        f = _Fields(raw, "", _names(SweepSpec, "source", "base_dir"))
        shards = _Fields(f.pop("shards") or {}, "shards", _names(ShardLimits))
        actors = _Fields(f.pop("actors") or {}, "actors", _names(ActorSpec))
        models = _listed(f.pop("models"), "models", _model)
        tasks = _tasks(f.pop("tasks"), models, base_dir)
        if any(task.loglikelihood for task in tasks):  # their engines keep vLLM's compiled default (ModelSpec)
            models = tuple(dataclasses.replace(model, loglikelihood=True) for model in models)
        spec = _build(
            SweepSpec, "",
            name=f.pop("name"), output=_or(f.pop("output"), f"results/{raw.get('name', 'sweep')}"),
            models=models, tasks=tasks,
            shards=_build(ShardLimits, "shards", **{k: shards.pop(k) for k in _names(ShardLimits)}),
            actors=_build(ActorSpec, "actors", **{k: actors.pop(k) for k in _names(ActorSpec)}),
            reproducible=_or(f.pop("reproducible"), False),
            source=source, base_dir=base_dir,
        )
    except ValueError as e:
        raise SpecError(f"{source}: {e}") from None
    return spec


class _NoDuplicateKeys:
    """Refuses a key given twice in one mapping (PyYAML keeps the last one quietly: a second `tasks:` would
    drop the first list). Keys merged in with `<<` may still be overridden."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class _StrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """PyYAML's safe loader: the reader of record, whose errors (and escapes) raysweep's messages follow."""


class _FastStrictLoader(_NoDuplicateKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """The same over libyaml's parser where PyYAML was built with it (a spec of 10,000 models: 1 s instead of
    4 s). A document it refuses is read again by `_StrictLoader`, which decides: libyaml refuses what PyYAML
    reads (an escaped surrogate pair) and words its errors otherwise."""


def _parse_yaml(text: str):
    try:
        return yaml.load(text, Loader=_FastStrictLoader)
    except yaml.YAMLError:
        return yaml.load(text, Loader=_StrictLoader)


def load_spec(path: str | os.PathLike) -> SweepSpec:
    path = Path(path)
    problem = file_problem(path, "spec file", ", not a spec file")  # before open: a named pipe would block it
    if problem is not None:
        raise SpecError(problem)
    try:
        raw = _parse_yaml(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise SpecError(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML: {problem}") from None
    except RecursionError:  # PyYAML composes recursively: `[[[[...` thousands deep
        raise SpecError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # an integer of more than 4,300 digits (Python's limit on int conversion)
        raise SpecError(f"{path}: not a value raysweep reads: {str(e).split(';')[0]}") from None
    if raw is None:
        raise SpecError(f"{path}: the spec file is empty")
    if isinstance(raw, dict):  # unknown keys before the walk: what a stray key's aliases hold is never walked
        try:
            _Fields(raw, "", _names(SweepSpec, "source", "base_dir"))
        except ValueError as e:
            raise SpecError(f"{path}: {e}") from None
    raw, _ = _TextOnly(str(path)).walk(raw)
    return parse_spec(raw, source=str(path), base_dir=str(path.resolve().parent))


class _TextOnly:
    """The document with surrogate pairs written as two escapes ("\\ud83d\\ude00", which PyYAML keeps as
    two code points) joined; a lone surrogate is not text, and is refused naming its field.
    YAML aliases make the document a graph: each aliased mapping or list is walked once (by its id), one
    that holds itself is refused, and so are nesting deeper than MAX_DEPTH and more than MAX_VALUES values
    with every alias expanded (a "billion laughs" chain would take minutes and gigabytes downstream)."""

    def __init__(self, source: str):
        self.source = source
        self.done: dict[int, tuple[Any, int]] = {}  # id -> (the walked value, its size with aliases expanded)
        self.open: set[int] = set()  # the containers being walked: meeting one again is a cycle

    def walk(self, value: Any, where: str = "", depth: int = 0) -> tuple[Any, int]:
        if isinstance(value, str):
            return _text(value, where, self.source), 1 + len(value) // 1024
        if not isinstance(value, (dict, list)):
            return value, 1
        key, at = id(value), where or "spec"
        if key in self.done:
            return self.done[key]
        if key in self.open:
            raise SpecError(f"{self.source}: {at}: holds itself (a recursive YAML alias)")
        if depth >= MAX_DEPTH:  # the field path cut where it gets long: it repeats `[0]` a hundred times
            raise SpecError(f"{self.source}: {at if len(at) <= 60 else at[:60] + '…'}: nested deeper than "
                            f"{MAX_DEPTH} levels")
        self.open.add(key)
        size = 1
        if isinstance(value, dict):
            out: Any = {}
            for k, v in value.items():
                if not isinstance(k, str):  # YAML reads `1:`, `true:`, `null:` as such; JSON and every setting name text
                    raise SpecError(f"{self.source}: {at}: key {k!r} is not text (YAML reads it as {type(k).__name__}): "
                                    "quote it")
                out[k], n = self.walk(v, f"{where}.{k}".lstrip("."), depth + 1)
                size += n
        else:
            out = []
            for i, v in enumerate(value):
                item, n = self.walk(v, f"{where}[{i}]", depth + 1)
                out.append(item)
                size += n
        if size > MAX_VALUES:
            raise SpecError(f"{self.source}: {at}: expands to more than {MAX_VALUES:,} values through YAML aliases")
        self.open.discard(key)
        self.done[key] = (out, size)
        return out, size


def _text(value: str, where: str, source: str) -> str:
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16") if _SURROGATE.search(value) else value
    except UnicodeDecodeError:
        lone = _SURROGATE.search(value).group().encode("unicode_escape").decode()
        raise SpecError(f"{source}: {where or 'spec'}: holds a lone surrogate ({lone}), which is not text") from None
