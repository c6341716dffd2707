"""Preflight checks (docs/design.md, Planning): every input that can be checked is checked here, before any actor starts
(cluster/plan/plan_source.py runs them, then plans).

1. Checks that need no tokenizer (`check_inputs`, cheap: jobs/sweep.py runs them before Ray starts):
   every task's data file streamed once (rows, columns, ids, the prompt rendered), every structured spec
   parsed, every model found (a local directory, the hub cache, or a hub that can be reached; vLLM
   importable where a model asks for it) and its max_model_len left room for max_tokens where known; what was
   found of each model (where it is on disk, its weights' size) is kept for the early engines (`FoundModel`).
   A problem here is one line naming the file, task, model or field, before any actor starts.
2. The expensive ones are planning's first step (cluster/plan/plan_source.py `load_models`): every model loads
   its tokenizer and length, and compiles every structured spec, on the planner's thread once Ray is up.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from cluster.contracts.errors import PreflightError
from cluster.contracts.task_spec import no_room
from cluster.contracts.model_paths import is_builtin
from cluster.inputs.builtin_model import built_path, find_model
from cluster.inputs.data import TaskData, load_task
from cluster.contracts.model_memory import Weights, accelerator_memory, refusal, weight_bytes, weights
from cluster.contracts.spec import ModelSpec, SweepSpec
from cluster.contracts.structured import check as check_structured


@dataclass(frozen=True)
class FoundModel:
    """A model the checks found without loading it: what is known of it before Ray is up (the early engines)."""
    model: ModelSpec
    on_disk: str | None  # where its engines load it from (a hub id as named); None: a builtin model not built yet
    path: str  # as the spec resolves it (`spec.model_path`)
    config: dict | None  # its config.json, as found
    sized: int | None = None  # its weights' bytes where the memory check sized them

    def weight_bytes(self) -> int | None:
        """Its weights at the dtype vLLM loads them in, where its files or config say: the memory check's size,
        else read now (only the early engines of a one-model sweep ask: not every model of every sweep)."""
        if self.sized is not None:
            return self.sized
        return weight_bytes(None if is_builtin(self.path) else self.path, self.config, self.model.engine)


@dataclass(frozen=True)
class CheckedInputs:
    """What `check_inputs` read: each task's data (for `plan_events` to plan from without reading the files again
    for checking) and each model found, by name."""
    data: list[TaskData]
    models: dict[str, FoundModel]


def check_inputs(spec: SweepSpec) -> CheckedInputs:
    """The checks that need no tokenizer and no model loaded, in one pass over each data file."""
    data = []
    for task in spec.tasks:
        if task.structured is not None:
            try:
                check_structured(task.structured)
            except ValueError as e:
                raise PreflightError(f"{spec.source}: tasks.{task.name}.structured.{e}") from None
        data.append(load_task(spec, task))
        if task.scorer is not None and task.scorer.name == "code_exec":
            check_sandbox(spec, task)
    return CheckedInputs(data, {model.name: check_model(spec, model) for model in spec.models})


def check_sandbox(spec: SweepSpec, task) -> None:
    """A code_exec task on a driver where no sandbox can run its programs (or only one that keeps the driver's
    uid, not asked for): one line now, not after the engines ran (the programs run on this node)."""
    from cluster.score.sandbox import SandboxError, check_available

    try:
        check_available(bool(task.scorer.args.get("unsafe_fallback", False)))
    except SandboxError as e:
        raise PreflightError(f"{spec.source}: tasks.{task.name}.scorer: {e}") from None


# `reproducible: true` runs vLLM with actors/vllm_engine.py REPRODUCIBLE_ARGS: the one setting under which
# vLLM 0.26 gave identical greedy outputs across batch sizes on an H100 (bench/records/h100-reproducible-mode.md)
REPRODUCIBLE_BACKEND = "TRITON_ATTN"


def check_batch_invariant(spec: SweepSpec, model: ModelSpec) -> None:
    """`reproducible: true` with an engine argument or task setting under which vLLM's outputs were seen to
    change with the batch: one line now, not a sweep whose outputs do not repeat. (The GPU's own capability
    is checked on the actor, before its engine starts.)"""
    engine, why = model.engine, None
    attention = engine.get("attention_config")
    backend = engine.get("attention_backend") or (attention.get("backend") if isinstance(attention, dict) else None)
    if isinstance(backend, str) and backend.upper() != REPRODUCIBLE_BACKEND:
        why = (f"the {backend} attention backend (on an H100 only {REPRODUCIBLE_BACKEND} repeated its outputs across "
               "batches; FLASH_ATTN differed even between identical batches): drop engine.attention_config")
    elif engine.get("enforce_eager"):
        why = ("enforce_eager (vLLM 0.26's eager kernels gave other outputs in other batches, on an H100; CUDA "
               "graphs and torch.compile did not): drop engine.enforce_eager")
    elif _graphs_or_compile_off(engine.get("compilation_config")):
        why = ("a compilation_config that turns CUDA graphs or torch.compile off (vLLM 0.26's eager kernels gave "
               "other outputs in other batches, on an H100): drop engine.compilation_config's mode and cudagraph_mode")
    elif model.gpus_per_engine > 1:
        why = (f"an engine across {model.gpus_per_engine} GPUs (tensor/pipeline parallel): the batch-invariant "
               "setting was measured on one GPU only, and a cross-GPU all-reduce is another batch-dependent sum")
    elif engine.get("enable_prefix_caching") or engine.get("enable_chunked_prefill"):
        key = "enable_prefix_caching" if engine.get("enable_prefix_caching") else "enable_chunked_prefill"
        why = f"{key} (whether a prompt's tokens are cached or chunked depends on its neighbours): drop engine.{key}"
    if why:
        raise PreflightError(f"{spec.source}: model {model.name}: reproducible: true cannot run with {why}")
    chunked = next((t for t in spec.tasks if t.chunked_prefill == "on"), None)
    if chunked is not None:
        raise PreflightError(f"{spec.source}: tasks.{chunked.name}.chunked_prefill: on cannot run with reproducible: "
                               "true (whether a prompt is chunked depends on its neighbours): use auto or off")


def _graphs_or_compile_off(compilation) -> bool:
    """A compilation_config that turns CUDA graphs (cudagraph_mode NONE) or torch.compile (mode 0/NONE) off."""
    if isinstance(compilation, int):
        return compilation == 0  # vLLM reads a bare integer as the compilation mode
    if not isinstance(compilation, dict):
        return False
    graphs, mode = compilation.get("cudagraph_mode"), compilation.get("mode", compilation.get("level"))
    return str(graphs).upper() == "NONE" or mode == 0 or str(mode).upper() == "NONE"


def check_parallel(spec: SweepSpec, model: ModelSpec, config: dict | None) -> None:
    """An engine across GPUs that vLLM would refuse once its GPUs are held, refused now: a tensor-parallel
    size that does not divide the attention heads, or another executor than the processes inside the
    actor that holds the engine's GPUs (vLLM's Ray executor would ask Ray for the GPUs again)."""
    tensor, executor = model.engine.get("tensor_parallel_size", 1), model.engine.get("distributed_executor_backend")
    heads = (config or {}).get("num_attention_heads")
    where = f"{spec.source}: model {model.name}: engine"
    if isinstance(heads, int) and heads > 0 and heads % tensor:
        fits = ", ".join(str(tp) for tp in (1, 2, 4, 8, 16) if heads % tp == 0)
        raise PreflightError(f"{where}.tensor_parallel_size {tensor} does not divide the model's {heads} attention "
                               f"heads (vLLM refuses it): use one of {fits}")
    if model.gpus_per_engine > 1 and executor not in (None, "mp"):
        raise PreflightError(f"{where}.distributed_executor_backend {executor!r}: raysweep's actor holds the engine's "
                               f"{model.gpus_per_engine} GPUs and runs vLLM's workers as its own processes (mp); "
                               "drop the field")


def check_memory(spec: SweepSpec, model: ModelSpec, path: str, config: dict | None) -> Weights | None:
    """A model whose weights cannot fit the GPUs of the spec's `accelerator_type`, at its tensor- and
    pipeline-parallel sizes: one line now, with the smallest tensor_parallel_size that fits (each actor
    checks its own GPU again before its engine starts: actors/evaluator.py). The weights it sized (None: not
    sized here)."""
    gpu_bytes = accelerator_memory(spec.actors.accelerator_type)
    if gpu_bytes is None or config is None or model.backend in ("hf", "fake"):
        return None
    try:
        found = weights(None if is_builtin(path) else path, config, model.engine)
    except (OSError, ValueError) as e:
        raise PreflightError(f"{spec.source}: model {model.name}: its weights cannot be sized for the "
                             f"{spec.actors.accelerator_type} memory check: {e}") from None
    why = found and refusal(model.name, model.engine, found, gpu_bytes, f"one {spec.actors.accelerator_type}",
                            1.0 if spec.actors.num_gpus is None else spec.actors.num_gpus,  # auto shares only what fits
                            config.get("num_attention_heads"))
    if why:
        raise PreflightError(f"{spec.source}: {why}")
    return found


def check_model(spec: SweepSpec, model: ModelSpec) -> FoundModel:
    """A model found without loading it, and max_tokens against its length where that is known now."""
    if model.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise PreflightError(f"{spec.source}: model {model.name}: engine backend vllm needs vLLM, which is not "
                               "installed here: pip install 'raysweep[vllm]' on a CUDA machine, or set `engine: hf`")
    if spec.reproducible:
        check_batch_invariant(spec, model)
    path = spec.model_path(model)
    try:
        config = find_model(path)
    except ValueError as e:
        where = f" ({path})" if path != model.path else ""
        raise PreflightError(f"{spec.source}: model {model.name}: cannot load {model.path!r}{where}: {e}") from None
    check_parallel(spec, model, config)
    sized = check_memory(spec, model, path, config)
    max_len = model.engine.get("max_model_len") or (config or {}).get("max_position_embeddings")
    for task in spec.tasks:
        if task.replay is None and isinstance(max_len, int) and task.sampling.max_tokens >= max_len:
            raise PreflightError(f"{spec.source}: {no_room(model, task, max_len)}")
    return FoundModel(model, built_path(path), path, config, sized.bytes if sized is not None else None)
