"""Engine settings the driver plans with and the actors start engines with: one value for both sides."""

from __future__ import annotations

import os

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
