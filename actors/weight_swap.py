"""A model change that keeps the engine: where the next model is another checkpoint of the model the engine runs
(the same architecture, tokenizer and generation settings, and the same settings in the spec but its name and
path), its weights are loaded into the running engine in place (`Engine.swap_weights`) instead of a new engine
being built. An evaluation of a training run's checkpoints thus pays one engine start per actor: vLLM's
torch.compile, memory profile, KV cache and CUDA graph capture are not done again, only the weights are read.

`why_not_swapped` says why a change cannot keep the engine (None where it can; what makes two folders checkpoints
of one model: cluster/contracts/checkpoint.py); the actor decides with it (actors/evaluator.py `start_engine`).
What vLLM does for it: docs/gpu.md, Model changes.
"""

from __future__ import annotations

import dataclasses
import os

from cluster.contracts.checkpoint import differences
from cluster.contracts.spec import ModelSpec

# the engines that load another checkpoint's weights in place
SWAPS = ("hf", "vllm")
# set to 0 in the actors' environment: every model change builds a new engine
SWAP_SWITCH = "RAYSWEEP_WEIGHT_SWAP"
# telemetry/actors figures of building an engine (cluster/contracts/telemetry_schema.py): none for a swap, whose
# weights_s is its loading of the weights
BUILD_FIGURES = ("engine_init_s", "warmup_s", "load_s", "weights_s", "core_init_s", "compile_s", "profile_run_s",
                 "graph_capture_s")


def why_not_swapped(kind: str, running: ModelSpec, running_path: str, model: ModelSpec, model_path: str) -> str | None:
    """Why the engine of `running` (of `kind`, its files at `running_path`) cannot run `model` by loading its
    weights (at `model_path`): None where it can."""
    if os.environ.get(SWAP_SWITCH) == "0":
        return f"{SWAP_SWITCH}=0 is set"
    if kind not in SWAPS:
        return f"the {kind} engine does not load another checkpoint's weights"
    if dataclasses.replace(running, name=model.name, path=model.path) != model:
        return "its settings in the spec differ"
    return differences(running_path, model_path)


def not_swapped(running: ModelSpec, model: ModelSpec, error: BaseException) -> RuntimeError:
    """The start's error where loading `model`'s weights into the engine of `running` raised `error`."""
    return RuntimeError(f"the weights of model {model.name} could not be loaded into the running engine of model "
                        f"{running.name} ({type(error).__name__}: {error})")
