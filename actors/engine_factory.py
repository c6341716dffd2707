"""Which engine an actor runs and how it is started: the backend chosen for a model (vLLM where CUDA and vLLM
are present, else the CPU engine), the imports done ahead while the driver plans, the GPU checks before vLLM
starts, and `make_engine`. The backends implement actors/engine.py's interface."""

from __future__ import annotations

import importlib.util
import math
import os

from actors.engine import Engine, EngineProfile
from cluster.contracts.spec import ModelSpec


def cuda_and_vllm_available() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def choose_backend(model: ModelSpec) -> str:
    if model.backend != "auto":
        return model.backend
    return "vllm" if cuda_and_vllm_available() else "hf"


# per backend: what its engine starts import. transformers imports a model's classes on first use, xgrammar its
# CPU mask kernel: the builtin models' (Llama) and the auto classes are imported here, or each engine forked from
# the engine host (actors/engine_host.py) would import them after the fork, 3-4 CPU-seconds on a 2-core machine
HF_CLASSES = ("transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
              "transformers.models.llama.modeling_llama", "xgrammar", "xgrammar.kernels.apply_token_bitmask_inplace_cpu")
PRELOADS = {"vllm": ("vllm", "transformers", "actors.vllm_engine"),
            "hf": ("torch", "transformers", *HF_CLASSES, "actors.hf_engine", "actors.shard_work"),
            "fake": ("transformers", "actors.fake_engine")}


def preload(backends, core_process: bool = True) -> None:
    """Import what the engines of `backends` need, once per process, before any model is known: an actor
    does this while the driver plans, so an engine start later pays for construction only.
    `core_process`: start vLLM's engine-core forkserver with it (an actor's process; the engine host,
    actors/engine_host.py, forks whole engine processes instead)."""
    import importlib

    for backend in {choose_backend(ModelSpec("preload", "-", backend=b)) for b in backends}:
        if backend == "vllm" and core_process:
            from actors import vllm_core_process

            # vLLM reads some settings at import: set first; and the forkserver's import starts beside ours
            vllm_core_process.start()
        for module in PRELOADS[backend]:
            importlib.import_module(module)
        if backend == "vllm":
            getattr(importlib.import_module("vllm"), "LLM")  # `vllm` imports lazily: this is the heavy part


def engine_cpu_threads(num_cpus: float, num_gpus: float, node_gpus: float | None) -> int | None:
    """A GPU actor's CPU threads for its engine (torch's and OpenMP's, through OMP_NUM_THREADS), set before
    torch and vLLM's engine-core forkserver start, so the forked engine core has them too. Ray sets
    OMP_NUM_THREADS to the actor's `num_cpus` (1 for raysweep's GPU actors) where nothing else set it, and vLLM
    then loads weights on one thread: builtin:large (13 GiB) on an H200 took 14.2 s to load with
    OMP_NUM_THREADS=1 and 4.5 s with 16, and the actor's engine init was 37.7 s against the plain script's
    18.1 s (bench/records/h200-lm-eval-templates-and-engine-threads.md). The share: this process's CPUs x its GPUs / the node's GPUs. A value
    other than Ray's default for this actor was set by someone (the user's runtime_env): it is kept. Returns
    the threads set, or None where nothing changed."""
    ray_default = str(max(math.floor(num_cpus), 1))
    if num_gpus <= 0 or os.environ.get("OMP_NUM_THREADS", ray_default) != ray_default:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, int(cpus * num_gpus / max(node_gpus or 1, num_gpus)))
    if threads <= int(ray_default):
        return None
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # vLLM 0.26 reads it as its engine starts (engine core and workers)
MIN_BATCH_INVARIANT_CAPABILITY = (8, 0)  # vLLM's invariant kernels need FlashAttention or Triton: sm80 and up


def runs_vllm(backends) -> bool:
    """Whether an engine of `backends` would be vLLM on this machine (`auto` resolved here)."""
    return "vllm" in {choose_backend(ModelSpec("check", "-", backend=b)) for b in backends}


def reproducible_refusal(backends) -> str | None:
    """Why this process's GPU cannot run vLLM's batch-invariant mode (`reproducible: true`), or None. vLLM
    0.26 checks nothing itself: on an older GPU the mode stays on and its kernels fail or are not invariant.
    Read through NVML, so no CUDA context opens in the actor."""
    if not runs_vllm(backends):
        return None  # the CPU engine runs reproducibly anywhere
    from actors.telemetry import gpu_capability, gpu_name

    capability = gpu_capability()
    if capability is None or capability >= MIN_BATCH_INVARIANT_CAPABILITY:
        return None
    return (f"reproducible: true needs vLLM's batch-invariant mode, which needs a GPU of compute capability "
            f"{'.'.join(map(str, MIN_BATCH_INVARIANT_CAPABILITY))} or more (A100, L4, H100 and newer); this actor's "
            f"{gpu_name() or 'GPU'} is {'.'.join(map(str, capability))}")


def check_gpus(model: ModelSpec, model_path: str, gpu_fraction: float) -> None:
    """Before vLLM starts: this actor sees the GPUs its model's engine spans (tensor x pipeline parallel),
    and the model's weights fit them (cluster/contracts/model_memory.py, against NVML's figure for this GPU)."""
    from actors.telemetry import gpu_name, gpu_total_bytes
    from cluster.contracts.model_memory import folder_config, refusal, weights

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if model.gpus_per_engine > 1 and len(visible) < model.gpus_per_engine:
        raise RuntimeError(f"model {model.name}: its engine spans {model.gpus_per_engine} GPUs (tensor x pipeline "
                           f"parallel), and this actor was given {len(visible)} (CUDA_VISIBLE_DEVICES={','.join(visible)})")
    total = gpu_total_bytes()
    config = folder_config(model_path)
    if config is None:
        return  # vLLM says what is wrong with the model itself
    found = weights(model_path, config, model.engine)
    why = total and found and refusal(model.name, model.engine, found, total, f"this actor's {gpu_name() or 'GPU'}",
                                      gpu_fraction, config.get("num_attention_heads"))
    if why:
        raise RuntimeError(why)


def make_engine(model: ModelSpec, model_path: str, profile: EngineProfile, num_threads: int | None,
                gpu_fraction: float = 1.0, sleep_mode: bool = False, reproducible: bool = False) -> Engine:
    """`sleep_mode`: the engine can `sleep` and `wake_up` (vLLM's sleep mode; the CPU engines keep their
    weights in memory either way, so theirs cost nothing). `reproducible`: outputs that do not depend on the
    batch: vLLM's batch-invariant mode (the process's VLLM_BATCH_INVARIANT, set by the actor before its
    imports), the CPU engine one row at a time."""
    backend = choose_backend(model)
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(f"model {model.name}: backend vllm needs vLLM: pip install 'raysweep[vllm]' "
                               "on a CUDA machine, or set `engine: hf`")
        from actors.vllm_engine import VllmEngine

        check_gpus(model, model_path, gpu_fraction)
        if reproducible and os.environ.get(BATCH_INVARIANT) != "1":
            raise RuntimeError(f"model {model.name}: reproducible: true, but {BATCH_INVARIANT} was not set in "
                               "this actor before vLLM started")
        return VllmEngine(model, model_path, profile, gpu_fraction=gpu_fraction, sleep_mode=sleep_mode,
                          reproducible=reproducible)
    if backend == "fake":
        from actors.fake_engine import FakeEngine

        return FakeEngine(model, model_path, profile)
    from actors.hf_engine import HFEngine

    return HFEngine(model, model_path, profile, num_threads=num_threads, one_row_at_a_time=reproducible)


def engine_tokenizer(engine: Engine, model_path: str):
    """The tokenizer a shard's prompts are encoded with: the engine's own where it has one (vLLM's, the CPU
    engine's), else the model folder's."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer
