"""What raysweep hands vLLM: the `LLM(...)` arguments of an engine (the spec's `engine` mapping, the profile's
scheduling, a shared GPU's KV-cache size, reproducible mode's settings) and each request's `SamplingParams`
arguments. Apart from actors/vllm_engine.py so the driver's tests and benchmarks read them without vLLM."""

from __future__ import annotations

import os
from pathlib import Path

from actors.engine import EngineProfile
from cluster.contracts.engine_defaults import DEFAULT_MAX_SEQS, shared_starts_together, starts_uncompiled
from cluster.contracts.model_memory import folder_config, shared_kv_cache_bytes, weight_bytes
from cluster.contracts.spec import ModelSpec, SamplingSpec, StructuredSpec
from cluster.contracts.task_spec import _is_int

LONG_MAX_SEQS = 64  # long shards keep fewer sequences in flight: their KV cache is large
MIN_SHARED_KV_BYTES = 1 << 30


def shared_kv_bytes(model: ModelSpec, model_path: str, gpu_fraction: float, total_bytes: int | None) -> int | None:
    """On a GPU shared with other engines, the KV cache's size in bytes, from the engine's share: the spec's
    `gpu_memory_utilization` of the GPU, or else 90% of its fraction, less its weights (the model folder's
    weight files) with a fifth more, less SHARED_MARGIN_BYTES (cluster/contracts/model_memory.py). vLLM otherwise
    sizes the cache from the free memory it measures before and after a test pass, which a neighbour starting or
    closing meanwhile falsifies (seen on an H100: "Error in memory profiling", or a cache sized wrong; on an H200, two engines of
    `gpu_memory_utilization: 0.3` started together: "No available memory for the cache blocks"). None where
    the spec sets `kv_cache_memory_bytes`, the GPU is whole, starts are serial, NVML cannot say the GPU's size,
    or the share leaves less than 1 GiB (then vLLM measures)."""
    if gpu_fraction >= 1 or not total_bytes or not shared_starts_together() or "kv_cache_memory_bytes" in model.engine:
        return None
    share = float(model.engine.get("gpu_memory_utilization", 0.9 * gpu_fraction))
    weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt")
                  for f in Path(model_path).glob(pattern)) if os.path.isdir(model_path) else 0
    kv = shared_kv_cache_bytes(share * total_bytes, weights)
    return kv if kv >= MIN_SHARED_KV_BYTES else None


# A large model's engine (cluster/contracts/engine_defaults.py `starts_uncompiled`: its weights over
# UNCOMPILED_MIN_WEIGHT_BYTES as vLLM loads them, counted as the planner counts them) starts without torch.compile and
# captures full CUDA graphs for its decode steps only (vLLM's compilation mode 0 with cudagraph_mode FULL_DECODE_ONLY;
# prefill and mixed steps run eager, with vLLM's own kernels). On one H200, a model of Llama-3-8B's shape, two
# engines on the GPU: ready in 17-20 s against 24-29 s compiled from vLLM's compile cache, and 28 s against 48 s with
# nothing of theirs in that cache; generation as fast (first shard to last 22.9-24.2 s against 23.1-24.0 s); the whole
# command a median of 62.4 s against 68.8 s over three rounds (bench/records/h200-8b-start-without-compile.md).
# Smaller models keep vLLM's compiled default (not measured without). Not where the spec sets compilation_config's
# mode or cudagraph_mode, enforce_eager or optimization_level, nor in reproducible mode (measured batch-invariant
# compiled), nor for a model whose engines may be asked for log-likelihoods (ModelSpec.loglikelihood): its numbers are
# to be lm-eval's vLLM backend's, which runs compiled, and uncompiled engines' are not: over lm-eval's suite on the
# same model, against `lm_eval --model vllm`, choices' log-likelihoods differed by up to 1.82 nats (HellaSwag, mean
# 0.26) and 11 of 1,330 documents' decisions differed where lm-eval's margin was 0.05-0.34 nats; compiled engines make
# all 1,330 decisions the same, within 0.075 nats (bench/records/h200-suite-8b-uncompiled.md and
# 2xh200-suite-8b-compiled.md).
UNCOMPILED = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


# `reproducible: true` (with VLLM_BATCH_INVARIANT=1): on an H100, vLLM 0.26 repeated greedy outputs across batch
# sizes (groups of 256, 64, 100 reversed: 1,312 of 1,312 each) only with these, CUDA graphs and torch.compile
# on. FLASH_ATTN (the default) differed even between two identical passes; eager mode (C++ kernels) differed
# between batch sizes with every attention backend (bench/records/h100-reproducible-mode.md). Chunked prefill is off:
# whether a prompt is chunked would depend on its neighbours in the shard.
REPRODUCIBLE_ARGS = {"attention_config": {"backend": "TRITON_ATTN"}, "enable_prefix_caching": False,
                     "enable_chunked_prefill": False}


# Engines across GPUs (tensor parallel) on machines that keep NVLink multicast off (NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1: multicast can take a host's shared GPUs out of service). On Hopper, vLLM 0.26
# fuses each all-reduce with the next RMSNorm through FlashInfer's all-reduce, whose default backend (`mnnvl`)
# is built on NVSwitch multicast memory. With multicast off, a plain `LLM(..., tensor_parallel_size=2)` script
# on a 4xH200 machine logged "Auto-selected flashinfer allreduce backend: mnnvl", then its workers failed with
# CUBLAS_STATUS_INTERNAL_ERROR and "an illegal memory access" and hung (docs/gpu.md). The fusion is turned off;
# the all-reduce is then vLLM's custom one (CUDA IPC over NVLink) or NCCL's. A spec that sets
# compilation_config.pass_config.fuse_allreduce_rms itself keeps its own choice.
NO_MULTICAST_PASSES = {"fuse_allreduce_rms": False}
# The same machines: vLLM's symmetric-memory all-reduce needs multicast too (torch says "not supported" and vLLM
# skips it); raysweep says so rather than leave it to a probe. Set in every engine's process before vLLM starts
# (actors/vllm_core_process.py); a value the user set is kept.
NO_MULTICAST_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
# vLLM 0.26 draws top-k/top-p samples with FlashInfer's sampler, except in a step where a request has a seed of its
# own: then with PyTorch's (v1/sample/ops/topk_topp_sampler.py, forward_cuda). raysweep seeds every sampled request
# (sampling_kwargs), so FlashInfer's sampler never draws one of its tokens. An engine's warm-up still runs it, and on
# a node where FlashInfer has not built its sampling module yet, that warm-up compiles it with nvcc first: with every
# cache empty, two 8B engines on an H200 built in 161.7 s with it on, 73.1-73.2 s with it off (docs/gpu.md). Off in
# every engine's process; a value the user set is kept.
NO_FLASHINFER_SAMPLER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
ENGINE_ENV = {**NO_MULTICAST_ENV, **NO_FLASHINFER_SAMPLER_ENV}


def engine_args(model: ModelSpec, model_path: str, profile: EngineProfile, gpu_fraction: float,
                kv_bytes: int | None = None, reproducible: bool = False) -> dict:
    """vLLM `LLM(...)` arguments: the spec's `engine` mapping as is, the profile's scheduling on top; the
    batch limit (`max_num_seqs`) is the spec's, the long profile's, DEFAULT_MAX_SEQS on a shared GPU or in
    reproducible mode, or else vLLM's own for a whole GPU, as a plain `LLM(...)` gets it (docs/gpu.md);
    `kv_bytes` (shared_kv_bytes) fixes the KV cache's size on a shared GPU; a large model starts UNCOMPILED;
    `reproducible`: REPRODUCIBLE_ARGS on top of all (preflight refused a spec that asks otherwise:
    cluster/inputs/checks.py check_batch_invariant)."""
    args = {"model": model_path, "tokenizer": model_path, "seed": 0,
            "gpu_memory_utilization": round(0.9 * min(gpu_fraction, 1.0), 3),  # actors sharing a GPU split it
            "disable_log_stats": False,  # per-request metrics (TTFT) exist only with stats on
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    if kv_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_bytes
    if gpu_fraction < 1 or reproducible:
        # vLLM's own batch defaults are for a whole GPU (by its size), not a share of one; reproducible mode was
        # measured batch-invariant with every batch inside the captured sizes (REPRODUCIBLE_ARGS)
        args["max_num_seqs"] = DEFAULT_MAX_SEQS
    if model.gpus_per_engine > 1:
        # the actor holds the engine's GPUs (one node's): vLLM's workers run as its processes, not Ray tasks
        args["distributed_executor_backend"] = "mp"
    args.update(model.engine)
    if profile.chunked_prefill:
        args["enable_chunked_prefill"] = True
        args["max_num_batched_tokens"] = profile.max_num_batched_tokens
        args["max_num_seqs"] = min(args.get("max_num_seqs", LONG_MAX_SEQS), LONG_MAX_SEQS,
                                   profile.max_num_batched_tokens)
    else:
        args["enable_chunked_prefill"] = False  # batched tokens default to max_model_len: nothing is chunked
        args.pop("max_num_batched_tokens", None)
    if reproducible:
        args.pop("max_num_batched_tokens", None)
        args.update(REPRODUCIBLE_ARGS, attention_config={**(args.get("attention_config") or {}),
                                                         **REPRODUCIBLE_ARGS["attention_config"]})
    given = args.pop("compilation_config", None)  # a mapping, or an integer: vLLM reads one as the mode
    compilation = {"mode": given} if _is_int(given) else dict(given or {})
    if starts_uncompiled(model, _weight_bytes(model_path, model), reproducible):
        compilation.update(UNCOMPILED)
    if "max_num_seqs" in args:  # else vLLM sizes both for the GPU (get_batch_defaults) and captures to match
        compilation.setdefault("max_cudagraph_capture_size", args["max_num_seqs"])
    if model.engine.get("tensor_parallel_size", 1) > 1:
        compilation["pass_config"] = {**NO_MULTICAST_PASSES, **(compilation.get("pass_config") or {})}
    args["compilation_config"] = compilation
    return args


def _weight_bytes(model_path: str, model: ModelSpec) -> int | None:
    """The model's weights as vLLM loads them, as the planner counts them; None where its config.json cannot be read
    or its weights cannot be counted (its engine then keeps vLLM's compiled default)."""
    return weight_bytes(model_path, folder_config(model_path), model.engine)


def sampling_kwargs(sampling: SamplingSpec, seed: int, structured: StructuredSpec | None) -> dict:
    """`SamplingParams` keyword arguments for one request (structured_outputs: StructuredOutputsParams'
    arguments). Every field a plain script's `SamplingParams(max_tokens=N, temperature=T)` leaves at vLLM's
    default is given that default (top_p 1.0, top_k 0, no stop strings); the seed only where sampling (a
    greedy request needs none, and a plain script gives none)."""
    guide = None
    if structured is not None:
        field = {"json_schema": "json", "choice": "choice", "regex": "regex", "grammar": "grammar"}[structured.kind]
        guide = {field: list(structured.value) if structured.kind == "choice" else structured.value}
    return {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "stop": list(sampling.stop) or None,
            "seed": seed if sampling.temperature > 0 else None, "structured_outputs": guide}


