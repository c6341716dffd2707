"""The sweep spec (docs/design.md, Spec): validated frozen dataclasses (cluster/inputs/spec_file.py reads them from YAML).

Each dataclass checks its own values in ``__post_init__`` and raises ``ValueError`` naming the field;
``load_spec`` (cluster/inputs/spec_file.py) reads the YAML strictly (a key given twice is an error, with its line), rejects unknown keys
(suggesting the known one a misspelling is closest to), and re-raises every problem as ``SpecError`` with
the file and the full field path (``quickstart.yaml: tasks[1].sampling.max_tokens: must be >= 1, got 0``).
Relative paths in a spec (`data:`, `output:`) are read from the spec file's folder, as docker-compose does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

from cluster.contracts.errors import RaysweepError
from cluster.contracts.task_spec import (CHUNKED_PREFILL, LENGTH_POLICIES, NAME_RE, SCORERS, STRUCTURED_KINDS,  # noqa: F401
                               TASK_TYPES, ReplaySpec, SamplingSpec, ScorerSpec, StructuredSpec, TaskSpec,
                               _check_name, _is_int, _is_number, _suggest)

BACKENDS = ("auto", "vllm", "hf", "fake")  # fake: returns at once, for orchestration benchmarks
# an engine across several GPUs of one node (vLLM's names); their product is the GPUs its actor holds
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size")
MAX_PARALLEL = 16
RAY_STEP = 0.0001  # the finest fraction of a resource Ray takes


class SpecError(RaysweepError, ValueError):
    """A sweep spec that cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # local directory (`~` expanded; relative: from the spec's folder where it starts with ./ or ../, has two
    # or more `/`, or is a folder there), a hub id (`name` or `org/name`, no such folder), or builtin:NAME
    path: str
    backend: str = "auto"  # auto: vLLM where CUDA and vLLM are present, else the CPU (transformers) engine
    engine: dict = field(default_factory=dict)  # passed to the engine as is (max_model_len, ...)
    # its engines may be asked for log-likelihoods (a sweep with loglikelihood tasks, `raysweep lm-eval`, a pool,
    # which serves any sweep): they keep vLLM's compiled default, as lm-eval's vLLM backend runs
    # (actors/vllm_args.py UNCOMPILED). Not read from a spec file: set by its reader from the tasks; not hashed
    loglikelihood: bool = False

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("path: a model directory, hub id or builtin:NAME (`raysweep models`) is required")
        if self.backend not in BACKENDS:
            raise ValueError(f"engine.backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        max_len = self.engine.get("max_model_len")
        if max_len is not None and (not _is_int(max_len) or max_len < 1):
            raise ValueError(f"engine.max_model_len: must be an integer >= 1, got {max_len!r}")
        seqs, share = self.engine.get("max_num_seqs"), self.engine.get("gpu_memory_utilization")
        if seqs is not None and (not _is_int(seqs) or seqs < 1):  # read by raysweep too: its batch, its memory share
            raise ValueError(f"engine.max_num_seqs: must be an integer >= 1, got {seqs!r}")
        if share is not None and (not _is_number(share) or not 0 < share <= 1):
            raise ValueError(f"engine.gpu_memory_utilization: must be a number in (0, 1], got {share!r}")
        compilation = self.engine.get("compilation_config")
        if compilation is not None and not isinstance(compilation, dict) and not _is_int(compilation):
            raise ValueError(f"engine.compilation_config: must be a mapping or an integer mode, got {compilation!r}")
        offload = self.engine.get("cpu_offload_gb")
        if offload is not None and (not _is_number(offload) or offload < 0):
            raise ValueError(f"engine.cpu_offload_gb: must be a number >= 0, got {offload!r}")
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
    # actors per model; None (left out): chosen once Ray is up (cluster/plan/engines_per_gpu.py): as many as the
    # cluster's GPUs hold at `num_gpus` each, or 1 without GPUs
    count: int | None = None
    # GPUs per actor (fractions share a GPU); ignored where the cluster has none; None (left out): chosen once Ray
    # is up: 0.25 or 0.5 (four or two engines per GPU) for small models on large GPUs, else 1
    num_gpus: float | None = None
    num_cpus: float = 1.0  # CPUs per actor; the CPU engine uses this many threads
    # e.g. "L4": actors go to nodes with this accelerator (Ray's accelerator_type:<name> resource), and
    # their GPUs are asked of the autoscaler even while the cluster has none (GPU groups at min 0)
    accelerator_type: str | None = None
    # shards each actor holds at once; None: enough that 4x the engine's batch is queued, but about half the
    # shards left waiting where many actors share few rows (cluster/plan/depth.py)
    shards_in_flight: int | None = None

    def __post_init__(self) -> None:
        if self.shards_in_flight is not None and (not _is_int(self.shards_in_flight)
                                                  or not 1 <= self.shards_in_flight <= 64):
            raise ValueError(f"shards_in_flight: must be an integer from 1 to 64, got {self.shards_in_flight!r}")
        if self.accelerator_type is not None and (not isinstance(self.accelerator_type, str)
                                                  or not NAME_RE.match(self.accelerator_type)):
            raise ValueError(f"accelerator_type: must be a name such as L4 or H100, got {self.accelerator_type!r}")
        if self.count is not None and (not _is_int(self.count) or self.count < 1):
            raise ValueError(f"count: must be an integer >= 1, got {self.count!r}")
        if self.num_gpus is not None and (not _is_number(self.num_gpus) or self.num_gpus < 0):
            raise ValueError(f"num_gpus: must be >= 0, got {self.num_gpus!r}")
        if not _is_number(self.num_cpus) or self.num_cpus <= 0:
            raise ValueError(f"num_cpus: must be > 0, got {self.num_cpus!r}")
        for name in ("num_gpus", "num_cpus"):  # Ray refuses a finer fraction only once the actor is asked for
            share = getattr(self, name)
            if share is not None and 0 < share < RAY_STEP:
                raise ValueError(f"{name}: {share!r} is below {RAY_STEP:g}, the finest fraction of a resource Ray "
                                 "takes")


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
        return _hash(self._hashed(with_placement))

    def _hashed(self, with_placement: bool = False) -> dict:
        """What `digest` hashes."""
        body = dataclasses.asdict(self)
        for key in ("output", "source", "base_dir"):
            body.pop(key)
        for model in body["models"]:  # derived from the tasks, which are hashed themselves
            model.pop("loglikelihood")
        for key, default in (("count", 1), ("num_gpus", 1.0)):  # left out: the defaults they had then
            if body["actors"][key] is None:
                body["actors"][key] = default
        if not self.reproducible:  # as before the field existed: outputs made then still resume
            body.pop("reproducible")
        for task in body["tasks"]:  # fields added later, at their defaults: the hash of a spec made before
            for key, default in (("type", "generate"), ("choices", None), ("pass_at", ()), ("replay", None),
                                 ("lm_eval", None), ("target_delimiter", None)):
                if task[key] == default:
                    task.pop(key)
            if "lm_eval" in task:  # its data is lm-eval's requests, cached where this machine keeps them; the
                task.pop("data")  # hashes of its documents and requests are checked apart (manifest, scoring)
                for key in ("documents", "requests"):
                    task["lm_eval"].pop(key, None)
                for key, default in (("seed", None), ("predict_only", False), ("samples", None), ("use_cache", None)):
                    if task["lm_eval"]["settings"][key] == default:  # added later: at their defaults, as before
                        task["lm_eval"]["settings"].pop(key)
            if task["sampling"]["n"] == 1:
                task["sampling"].pop("n")
        if not with_placement:  # whether actors have GPUs stays: it decides the engine (vLLM or the CPU one)
            body["actors"] = {"gpus": self.actors.num_gpus is None or self.actors.num_gpus > 0}
        return body

    def digest_parts(self) -> dict[str, str]:
        """The digest's body hashed by part: each field of each model and task (`tasks.qa.prompt`), every other
        field by its key; an output records them, so a resume refused for another spec can name what changed."""
        parts = {}
        for key, value in self._hashed().items():
            if key in ("models", "tasks"):
                parts.update({f"{key}.{item['name']}.{field}": _hash(v) for item in value for field, v in item.items()})
            else:
                parts[key] = _hash(value)
        return parts


def _hash(body) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]
