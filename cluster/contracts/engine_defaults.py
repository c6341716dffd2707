"""Engine settings the driver plans with and the actors start engines with: one value for both sides."""

from __future__ import annotations

import os

from cluster.contracts.model_memory import GIB
from cluster.contracts.spec import ModelSpec

# The batch (vLLM's max_num_seqs) the driver plans shard depth for, and the one an engine sharing its GPU runs
# with, where a model's `engine:` sets none. An engine with a whole GPU takes vLLM's own default for that GPU.
DEFAULT_MAX_SEQS = 256
SHARED_GPU_START = "RAYSWEEP_SHARED_GPU_START"  # `serial`: engines sharing a GPU start one at a time


def shared_starts_together() -> bool:
    """Whether engines sharing a GPU start at the same time (default: each sizes its KV cache from its share,
    actors/vllm_args.shared_kv_bytes, so nothing depends on what a neighbour holds at that moment) or one
    at a time (`RAYSWEEP_SHARED_GPU_START=serial`: vLLM measures free memory, which a neighbour must not move).
    Read by the driver and by actors; actors of a local Ray inherit the driver's environment."""
    return os.environ.get(SHARED_GPU_START, "together") != "serial"


# A large model's engine starts without torch.compile (actors/vllm_args.py UNCOMPILED says how and why): its weights
# over UNCOMPILED_MIN_WEIGHT_BYTES as vLLM loads them (cluster/contracts/model_memory.py weight_bytes), where neither
# the spec (compilation_config's mode, level or cudagraph_mode, enforce_eager, optimization_level) nor reproducible
# mode decides compilation or graphs and no log-likelihood is asked of it (ModelSpec.loglikelihood). The actor
# starts its engine so; the driver gives such a model one engine per GPU (cluster/plan/engines_per_gpu.py).
UNCOMPILED_MIN_WEIGHT_BYTES = 2 * GIB
COMPILE_KEYS = ("mode", "level", "cudagraph_mode")  # compilation_config's keys that decide it
ENGINE_COMPILE_KEYS = ("enforce_eager", "optimization_level")  # engine arguments that decide it


def starts_uncompiled(model: ModelSpec, weight_bytes: int | None, reproducible: bool) -> bool:
    """Whether `model`'s engines start uncompiled, its weights taking `weight_bytes` (None: not known, and so not)."""
    compilation = model.engine.get("compilation_config")
    compilation = {} if compilation is None else compilation  # null is vLLM's default, 0 is a mode
    decided = not isinstance(compilation, dict) or any(k in compilation for k in COMPILE_KEYS) or \
        any(k in model.engine for k in ENGINE_COMPILE_KEYS)  # a bare integer (0 too): vLLM reads it as the mode
    if reproducible or decided or model.loglikelihood:
        return False
    return (weight_bytes or 0) > UNCOMPILED_MIN_WEIGHT_BYTES
