"""The sweep spec (DESIGN §2): YAML in, validated frozen dataclasses out.

Each dataclass checks its own values in ``__post_init__`` and raises ``ValueError`` naming the field;
``load_spec`` reads the YAML strictly (a key given twice is an error, with its line), rejects unknown keys
(suggesting the known one a misspelling is closest to), and re-raises every problem as ``SpecError`` with
the file and the full field path (``quickstart.yaml: tasks[1].sampling.max_tokens: must be >= 1, got 0``).
Relative paths in a spec (`data:`, `output:`) are read from the spec file's folder, as docker-compose does.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.contracts.errors import RaysweepError
from cluster.contracts.task_spec import (CHUNKED_PREFILL, LENGTH_POLICIES, NAME_RE, SCORERS, STRUCTURED_KINDS,  # noqa: F401
                               TASK_TYPES, ReplaySpec, SamplingSpec, ScorerSpec, StructuredSpec, TaskSpec,
                               _check_name, _is_int, _is_number, _suggest)

_SURROGATE = re.compile("[\ud800-\udfff]")  # a code point of a UTF-16 pair: alone, not text

BACKENDS = ("auto", "vllm", "hf", "fake")  # fake: returns at once, for orchestration benchmarks
MAX_DEPTH = 100  # nesting levels in a spec, at most
MAX_VALUES = 1_000_000  # values in a spec with every YAML alias expanded, at most
# an engine across several GPUs of one node (vLLM's names); their product is the GPUs its actor holds
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")
MAX_PARALLEL = 16


class SpecError(RaysweepError, ValueError):
    """A sweep spec that cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # local directory (`~` expanded; relative: from the spec's folder where it starts with ./ or ../, has two
    # or more `/`, or is a folder there), a hub id (`name` or `org/name`, no such folder), or builtin:tiny
    path: str
    backend: str = "auto"  # auto: vLLM where CUDA and vLLM are present, else the CPU (transformers) engine
    engine: dict = field(default_factory=dict)  # passed to the engine as is (max_model_len, ...)

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("path: a model directory, hub id or builtin:tiny is required")
        if self.backend not in BACKENDS:
            raise ValueError(f"engine.backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        max_len = self.engine.get("max_model_len")
        if max_len is not None and (not _is_int(max_len) or max_len < 1):
            raise ValueError(f"engine.max_model_len: must be an integer >= 1, got {max_len!r}")
        for key in PARALLEL_SIZES:
            size = self.engine.get(key, 1)
            if not _is_int(size) or not 1 <= size <= MAX_PARALLEL:
                raise ValueError(f"engine.{key}: must be an integer from 1 to {MAX_PARALLEL} (GPUs of one node), "
                                 f"got {size!r}")

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one engine spans: tensor_parallel_size x pipeline_parallel_size (1 for most models)."""
        tensor, pipeline = (self.engine.get(key, 1) for key in PARALLEL_SIZES)
        return tensor * pipeline


@dataclass(frozen=True)
class ShardLimits:
    max_samples: int = 512  # samples per shard at most
    max_tokens: int = 262_144  # prompt + max output tokens per shard at most

    def __post_init__(self) -> None:
        for name in ("max_samples", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ActorSpec:
    count: int = 1  # actors per model
    num_gpus: float = 1.0  # GPUs per actor (fractions share a GPU); ignored where the cluster has none
    num_cpus: float = 1.0  # CPUs per actor; the CPU engine uses this many threads
    # e.g. "L4": actors go to nodes with this accelerator (Ray's accelerator_type:<name> resource), and
    # their GPUs are asked of the autoscaler even while the cluster has none (GPU groups at min 0)
    accelerator_type: str | None = None
    # shards each actor holds at once; None: enough that 4x the engine's batch is queued (cluster/schedule/run.py)
    shards_in_flight: int | None = None

    def __post_init__(self) -> None:
        if self.shards_in_flight is not None and (not _is_int(self.shards_in_flight)
                                                  or not 1 <= self.shards_in_flight <= 64):
            raise ValueError(f"shards_in_flight: must be an integer from 1 to 64, got {self.shards_in_flight!r}")
        if self.accelerator_type is not None and (not isinstance(self.accelerator_type, str)
                                                  or not NAME_RE.match(self.accelerator_type)):
            raise ValueError(f"accelerator_type: must be a name such as L4 or H100, got {self.accelerator_type!r}")
        if not _is_int(self.count) or self.count < 1:
            raise ValueError(f"count: must be an integer >= 1, got {self.count!r}")
        if not _is_number(self.num_gpus) or self.num_gpus < 0:
            raise ValueError(f"num_gpus: must be >= 0, got {self.num_gpus!r}")
        if not _is_number(self.num_cpus) or self.num_cpus <= 0:
            raise ValueError(f"num_cpus: must be > 0, got {self.num_cpus!r}")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    output: str  # local path (relative: from the spec's folder, as `data:`) or a pyarrow filesystem URI
    models: tuple[ModelSpec, ...]
    tasks: tuple[TaskSpec, ...]
    shards: ShardLimits = field(default_factory=ShardLimits)
    actors: ActorSpec = field(default_factory=ActorSpec)
    # outputs that do not depend on batches: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1), the CPU
    # engine one row at a time; greedy and seeded outputs repeat whatever the shards, actors or a resume
    reproducible: bool = False
    source: str = "<spec>"  # the file it came from, for error messages
    base_dir: str = "."  # relative paths (data, output) are resolved from here: the spec's folder

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not isinstance(self.output, str) or not self.output:
            raise ValueError(f"output: must be a path or a filesystem URI (a string), got {self.output!r}")
        if not isinstance(self.reproducible, bool):
            raise ValueError(f"reproducible: must be true or false, got {self.reproducible!r}")
        if not self.models and (not self.tasks or any(t.replay is None for t in self.tasks)):
            raise ValueError("models: at least one model is required (only a sweep of replay tasks needs none)")
        if not self.tasks:
            raise ValueError("tasks: at least one task is required")
        for what, items in (("models", self.models), ("tasks", self.tasks)):
            names = [item.name for item in items]
            dup = next((n for n in names if names.count(n) > 1), None)
            if dup:
                raise ValueError(f"{what}: name {dup!r} is used twice")
        models = [m.name for m in self.models]
        for i, task in enumerate(self.tasks):  # replayed results would be filed (and planned) as that model's
            if task.replay is not None and task.replay.model in models:
                raise ValueError(f"tasks[{i}].replay.model: {task.replay.model!r} is the name of models"
                                 f"[{models.index(task.replay.model)}]; replayed completions are not that model's: "
                                 "give them a name of their own")

    def data_path(self, task: TaskSpec) -> str:
        return self._from_base(task.data)

    def output_path(self) -> str:
        """The output by the same rule as `data:`: a relative path from the spec's folder; a URI as given.
        (A `--output` on the command line is relative to the current directory, as any argument is.)"""
        return self.output if "://" in self.output else self._from_base(self.output)

    def model_path(self, model: ModelSpec) -> str:
        """A model's path: `~` expanded; a relative local path by the same rule as `data:`, from the spec's
        folder; a hub id (`name` or `org/name` that is no folder beside the spec) or a `builtin:` name as
        given. Local is: absolute, `./` or `../`, more than one `/` (no hub id has two), or existing
        beside the spec (cluster/contracts/model_paths.py: `is_local_path`, which `find_model` applies)."""
        from cluster.contracts.model_paths import is_builtin, is_local_path

        if is_builtin(model.path):
            return model.path
        path = os.path.expanduser(model.path)
        if is_local_path(path) or os.path.exists(self._from_base(path)):
            return self._from_base(path)
        return path

    def _from_base(self, path: str) -> str:
        path = os.path.expanduser(path)
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(self.base_dir, path))

    def digest(self, with_placement: bool = False) -> str:
        """Hash of everything in the spec that changes results: not the output location, and of `actors:`
        only whether they have GPUs (not how many actors, GPU shares, accelerator type), so a sweep resumes
        on another placement. The data files' contents are checked apart (cluster/inputs/data.py: data_hashes).
        `with_placement=True`: the hash outputs made before 2026-11-22 recorded, which covered `actors:`."""
        body = dataclasses.asdict(self)
        for key in ("output", "source", "base_dir"):
            body.pop(key)
        if not self.reproducible:  # as before the field existed: outputs made then still resume
            body.pop("reproducible")
        for task in body["tasks"]:  # fields added later, at their defaults: the hash of a spec made before
            for key, default in (("type", "generate"), ("choices", None), ("pass_at", ()), ("replay", None)):
                if task[key] == default:
                    task.pop(key)
            if task["sampling"]["n"] == 1:
                task["sampling"].pop("n")
        if not with_placement:  # whether actors have GPUs stays: it decides the engine (vLLM or the CPU one)
            body["actors"] = {"gpus": self.actors.num_gpus > 0}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


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


def parse_spec(raw: Any, source: str = "<spec>", base_dir: str = ".") -> SweepSpec:
    """Validate a parsed YAML document; errors are SpecError naming `source` and the field."""
    try:
        f = _Fields(raw, "", _names(SweepSpec, "source", "base_dir"))
        shards = _Fields(f.pop("shards") or {}, "shards", _names(ShardLimits))
        actors = _Fields(f.pop("actors") or {}, "actors", _names(ActorSpec))
        spec = _build(
            SweepSpec, "",
            name=f.pop("name"), output=_or(f.pop("output"), f"results/{raw.get('name', 'sweep')}"),
            models=_listed(f.pop("models"), "models", _model),
            tasks=_listed(f.pop("tasks"), "tasks", _task),
            shards=_build(ShardLimits, "shards", **{k: shards.pop(k) for k in _names(ShardLimits)}),
            actors=_build(ActorSpec, "actors", **{k: actors.pop(k) for k in _names(ActorSpec)}),
            reproducible=_or(f.pop("reproducible"), False),
            source=source, base_dir=base_dir,
        )
    except ValueError as e:
        raise SpecError(f"{source}: {e}") from None
    return spec


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one quietly:
    a second `tasks:` would drop the first list). Keys merged in with `<<` may still be overridden."""

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


def load_spec(path: str | os.PathLike) -> SweepSpec:
    path = Path(path)
    try:
        raw = yaml.load(path.read_bytes().decode("utf-8"), Loader=_StrictLoader)
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a spec file") from None
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
