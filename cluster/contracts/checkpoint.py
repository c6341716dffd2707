"""Whether two model folders hold checkpoints of one model: the same config.json but the keys that name it, the
same files that make its tokenizer, its generation defaults and its own code, byte for byte, and safetensors files
that hold the same tensors (names and shapes, read from their headers). Such a model's engine runs another
checkpoint by loading its weights alone (actors/weight_swap.py decides, the actor's side); the scheduler gives an
actor whose model is done another checkpoint of it first, where the work is even (`family`,
cluster/schedule/fleet.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from cluster.contracts.model_memory import folder_config, safetensors_tensors, weight_files
from cluster.contracts.spec import ModelSpec

# config.json keys that name a checkpoint or the library that wrote it, not the model it describes
NAMING_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version"})
# what PreTrainedTokenizerFast.from_pretrained reads of a local folder (cluster/inputs/model_files.py reads it too)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
# the files that make the tokenizer (a slow one's vocabularies too) and the generation defaults an engine reads at
# its start, compared byte for byte with the model's own code (*.py) where it has any: a model's weights are the
# only thing that differs
SAME_FILES = (*TOKENIZER_FILES, "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def differences(folder: str, other: str) -> str | None:
    """What makes the model at `other` not another checkpoint of the one at `folder` (None where nothing does)."""
    configs = [model_config(path) for path in (folder, other)]
    if None in configs:
        return "no local config.json to compare"
    if configs[0] != configs[1]:
        return "its config.json differs"
    differ = [name for name in _compared(folder, other) if read(folder, name) != read(other, name)]
    if differ:
        return f"its {', '.join(differ)} differ{'s' if len(differ) == 1 else ''}"
    # vLLM loads into a running engine whatever tensors the files hold and keeps its own for the rest, where a new
    # engine refuses a checkpoint that lacks one: the same tensors, or no swap
    tensors = [weight_tensors(path) for path in (folder, other)]
    if None in tensors:
        return "no safetensors weights to compare"
    return "its weight tensors differ" if tensors[0] != tensors[1] else None


def weight_tensors(folder: str) -> dict[str, list[int]] | None:
    """Each tensor's name and shape in the safetensors files vLLM loads from the folder
    (cluster/contracts/model_memory.py `weight_files`), from their headers alone; None where it has none, or one
    cannot be read."""
    tensors: dict[str, list[int]] = {}
    try:
        for path in weight_files(folder):
            tensors.update(safetensors_tensors(path))
    except (OSError, ValueError):
        return None
    return tensors or None


def family(model: ModelSpec, folder: str) -> str | None:
    """A digest equal for every checkpoint of one model given the same settings in the spec (its name and path
    aside); None where the folder has no config.json to read."""
    config = model_config(folder)
    if config is None:
        return None
    settings = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name not in ("name", "path")}
    digest = hashlib.sha256(json.dumps([settings, config], sort_keys=True, default=str).encode())
    for name in _compared(folder, folder):
        digest.update(name.encode() + b"\0" + (read(folder, name) or b"\0absent"))
    return digest.hexdigest()


def model_config(folder: str) -> dict | None:
    """config.json but the keys that name the checkpoint; None where it cannot be read."""
    config = folder_config(folder)
    return None if config is None else {key: value for key, value in config.items() if key not in NAMING_KEYS}


def read(folder: str, name: str) -> bytes | None:
    try:
        with open(os.path.join(folder, name), "rb") as f:
            return f.read()
    except OSError:
        return None


def _compared(folder: str, other: str) -> list[str]:
    """SAME_FILES, then the model's own code files (*.py) of either folder."""
    return [*SAME_FILES, *sorted(_code_files(folder) | _code_files(other))]


def _code_files(folder: str) -> set[str]:
    try:
        return {name for name in os.listdir(folder) if name.endswith(".py")}
    except OSError:
        return set()
