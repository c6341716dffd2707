"""A model change that keeps the engine: where the next model is another checkpoint of the model the engine runs
(the same architecture, tokenizer and generation settings, and the same settings in the spec but its name and
path), its weights are loaded into the running engine in place (`Engine.swap_weights`) instead of a new engine
being built. An evaluation of a training run's checkpoints thus pays one engine start per actor: vLLM's
torch.compile, memory profile, KV cache and CUDA graph capture are not done again, only the weights are read.

`why_not_swapped` says why a change cannot keep the engine (None where it can); the actor decides with it
(actors/evaluator.py `start_engine`). What vLLM does for it: docs/gpu.md, Model changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from cluster.contracts.spec import ModelSpec

# config.json keys that name a checkpoint or the library that wrote it, not the model it describes
NAMING_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version"})
# the files that make the tokenizer and the generation defaults the engine read at its start, compared byte
# for byte with the model's own code (*.py) where it has any: the weights are the only thing a swap reads
SAME_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
              "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json")
# the engines that load another checkpoint's weights in place; vLLM's only where RAYSWEEP_VLLM_WEIGHT_SWAP=1 is set
# (its test, tests/test_gpu.py test_a_checkpoint_after_another_on_one_vllm_engine_gives_its_own_rows, has not run
# on a GPU yet)
SWAPS = ("hf", "vllm")
VLLM_SWAP_SWITCH = "RAYSWEEP_VLLM_WEIGHT_SWAP"
# telemetry/actors figures of building an engine (cluster/contracts/telemetry_schema.py): none for a swap, whose
# weights_s is its loading of the weights
BUILD_FIGURES = ("engine_init_s", "warmup_s", "load_s", "weights_s", "core_init_s", "compile_s", "profile_run_s",
                 "graph_capture_s")


def why_not_swapped(kind: str, running: ModelSpec, running_path: str, model: ModelSpec, model_path: str) -> str | None:
    """Why the engine of `running` (of `kind`, its files at `running_path`) cannot run `model` by loading its
    weights (at `model_path`): None where it can."""
    if kind not in SWAPS:
        return f"the {kind} engine does not load another checkpoint's weights"
    if kind == "vllm" and os.environ.get(VLLM_SWAP_SWITCH) != "1":
        return f"the vllm engine loads another checkpoint's weights only where {VLLM_SWAP_SWITCH}=1"
    if dataclasses.replace(running, name=model.name, path=model.path) != model:
        return "its settings in the spec differ"
    configs = [_config(path) for path in (running_path, model_path)]
    if None in configs:
        return "no local config.json to compare"
    if configs[0] != configs[1]:
        return "its config.json differs"
    names = [*SAME_FILES, *sorted(_code_files(running_path) | _code_files(model_path))]
    differ = [name for name in names if _read(running_path, name) != _read(model_path, name)]
    return f"its {', '.join(differ)} differ{'s' if len(differ) == 1 else ''}" if differ else None


def _code_files(folder: str) -> set[str]:
    """The model's own code beside its weights (a `trust_remote_code` model's modeling_*.py)."""
    try:
        return {name for name in os.listdir(folder) if name.endswith(".py")}
    except OSError:
        return set()


def say_not_swapped(model: ModelSpec, error: BaseException) -> None:
    """A swap that raised: the engine is closed and a new one started for `model` (the line says why)."""
    print(f"[raysweep] model {model.name}: its weights could not be loaded into the running engine "
          f"({type(error).__name__}: {error}); a new engine starts for it", file=sys.stderr, flush=True)


def _config(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return {key: value for key, value in config.items() if key not in NAMING_KEYS} if isinstance(config, dict) else None


def _read(folder: str, name: str) -> bytes | None:
    try:
        with open(os.path.join(folder, name), "rb") as f:
            return f.read()
    except OSError:
        return None
