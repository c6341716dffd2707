"""The Engine interface every backend implements, and the choice of backend for an actor.

An engine holds one model and turns requests (token ids + a per-sample seed) into completions. The
sampling and structured-output settings are per call (one task's shard). Backends:
- `hf`   (actors/hf_engine.py): transformers on CPU (or any torch device), xgrammar token masks.
- `vllm` (actors/vllm_engine.py): vLLM on a GPU, CUDA graphs, chunked prefill by profile, xgrammar.
- `fake` (actors/fake_engine.py): a fake that answers at once, for measuring orchestration alone.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Protocol, Sequence

from cluster.contracts.spec import ModelSpec, SamplingSpec, StructuredSpec


@dataclass(frozen=True)
class GenRequest:
    sample_id: str
    prompt_token_ids: list[int]
    seed: int  # used when temperature > 0


@dataclass
class GenResult:
    sample_id: str
    output_text: str
    output_tokens: int
    finish_reason: str  # stop (EOS, stop string or grammar end) | length
    latency_s: float | None  # request submitted -> last token
    ttft_s: float | None  # request submitted -> first token


@dataclass(frozen=True)
class LoglikRequest:
    """One multiple-choice row: its context and each choice's continuation, as token ids
    (cluster/contracts/loglikelihood.py: encode_pairs). Each choice is scored on context + continuation."""
    sample_id: str
    context_ids: list[int]
    continuations: list[list[int]]


@dataclass
class LoglikResult:
    sample_id: str
    logprobs: list[float]  # per choice: the sum of its tokens' log-probabilities given what precedes them
    greedy: list[bool]  # per choice: every one of its tokens was the most likely one
    latency_s: float | None  # request submitted -> every choice scored


@dataclass(frozen=True)
class EngineProfile:
    """How an engine is configured for a class of shards (DESIGN §3)."""
    name: str = "short"  # short | long
    chunked_prefill: bool = False
    max_num_batched_tokens: int | None = None


class Engine(Protocol):
    kind: str  # "hf" | "vllm"
    profile: EngineProfile

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 structured: StructuredSpec | None) -> list[GenResult]:
        """Completions in the order of `requests`."""

    def loglikelihood(self, requests: Sequence[LoglikRequest]) -> list[LoglikResult]:
        """Each choice's log-likelihood given its context, in the order of `requests` (raw log-softmax of
        the model's logits: no temperature or other processing)."""

    def startup(self) -> dict:
        """Measured start-up figures: engine_init_s (construction), warmup_s, load_s (both), compile_s,
        graph_capture_s, cuda_graphs, graph_mode, fallback_reason (None where not measured or not
        applicable)."""

    def sleep(self) -> None:
        """Give the accelerator's memory back while keeping the model, for a quick `wake_up` (engines made
        with `sleep_mode`: a pool replica that switches between models)."""

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


def runs_profile(engine: Engine, profile: EngineProfile) -> bool:
    """Whether `engine` can run a shard of `profile` without a restart. The CPU engine has no chunked
    prefill, so any profile runs on it; vLLM (and the fake, which stands in for it) restart."""
    return engine.kind == "hf" or engine.profile == profile


def check_requests(requests: Sequence[GenRequest]) -> None:
    """Reject what no engine can run, with the sample named (vLLM refuses empty prompts too)."""
    for r in requests:
        if not r.prompt_token_ids:
            raise ValueError(f"sample {r.sample_id}: the prompt is empty (0 tokens)")


def check_loglik_requests(requests: Sequence[LoglikRequest]) -> None:
    """A choice is scored on the tokens before it: the context must hold one, and each choice a token."""
    for r in requests:
        if not r.context_ids:
            raise ValueError(f"sample {r.sample_id}: the context is empty (0 tokens): a choice's first token has "
                             "nothing to be predicted from")
        empty = next((j for j, c in enumerate(r.continuations) if not c), None)
        if empty is not None:
            raise ValueError(f"sample {r.sample_id}: choice {empty} is 0 tokens after the context")


def cuda_and_vllm_available() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def choose_backend(model: ModelSpec) -> str:
    if model.backend != "auto":
        return model.backend
    return "vllm" if cuda_and_vllm_available() else "hf"


def preload(backends) -> None:
    """Import what the engines of `backends` need, once per process, before any model is known: an actor
    does this while the driver plans, so an engine start later pays for construction only."""
    import importlib

    for backend in {choose_backend(ModelSpec("preload", "-", backend=b)) for b in backends}:
        if backend == "vllm":
            from actors import vllm_core_process

            # vLLM reads some settings at import: set first; and the forkserver's import starts beside ours
            vllm_core_process.start()
        modules = {"vllm": ("vllm", "transformers"), "hf": ("torch", "transformers"),
                   "fake": ("transformers",)}[backend]
        for module in modules:
            importlib.import_module(module)
        if backend == "vllm":
            getattr(importlib.import_module("vllm"), "LLM")  # `vllm` imports lazily: this is the heavy part


BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # vLLM 0.26 reads it as its engine starts (engine core and workers)
MIN_BATCH_INVARIANT_CAPABILITY = (8, 0)  # vLLM's invariant kernels need FlashAttention or Triton: sm80 and up


def reproducible_refusal(backends) -> str | None:
    """Why this process's GPU cannot run vLLM's batch-invariant mode (`reproducible: true`), or None. vLLM
    0.26 checks nothing itself: on an older GPU the mode stays on and its kernels fail or are not invariant.
    Read through NVML, so no CUDA context opens in the actor."""
    if "vllm" not in {choose_backend(ModelSpec("check", "-", backend=b)) for b in backends}:
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
    import json

    from actors.telemetry import gpu_name, gpu_total_bytes
    from cluster.contracts.model_memory import refusal, weights

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if model.gpus_per_engine > 1 and len(visible) < model.gpus_per_engine:
        raise RuntimeError(f"model {model.name}: its engine spans {model.gpus_per_engine} GPUs (tensor x pipeline "
                           f"parallel), and this actor was given {len(visible)} (CUDA_VISIBLE_DEVICES={','.join(visible)})")
    total = gpu_total_bytes()
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
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
