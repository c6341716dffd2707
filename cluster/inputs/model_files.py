"""What the driver reads of a model folder: its tokenizer and its context length, without importing torch.

`AutoTokenizer` and `AutoConfig` import transformers' model configuration code, and with it torch: 9.8 of a
10.7 s plan of 1,312 prompts on this 2-core machine, and 11 s of planning before a warm pool's first shard on
an H200 machine (bench/h200-2026-11-26-s16.md). The driver needs neither torch nor a model: a folder whose
tokenizer_config.json names transformers' generic fast tokenizer (`PreTrainedTokenizerFast`, as the builtin
models and Llama 3 do; no remote code) gets that class directly, which imports no torch; its context length
is read from config.json. Anything else (another class, remote code, a hub id) goes through AutoTokenizer,
as before.
"""

from __future__ import annotations

import json
import os

# config.json keys that hold a model's context length, in the order AutoConfig's attribute maps resolve
# `max_position_embeddings` (GPT-2's n_positions)
LENGTH_KEYS = ("max_position_embeddings", "n_positions")
GENERIC = ("PreTrainedTokenizerFast", "TokenizersBackend")  # the class names of transformers' generic fast tokenizer


def load_tokenizer(path: str):
    """The tokenizer of a local model folder (or hub id) as AutoTokenizer would load it."""
    import transformers

    named = _named_class(path)
    if named is not None:
        return named.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def context_length(path: str) -> int | None:
    """The model's max_position_embeddings (or n_positions) from config.json; a config that names neither (or
    a hub id) goes through AutoConfig, whose attribute maps may know the model's own name for it."""
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError(f"{config}: not a JSON object")
        found = next((raw[k] for k in LENGTH_KEYS if isinstance(raw.get(k), int)), None)
        if found is not None:
            return found
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)


def _named_class(path: str):
    """transformers' generic fast tokenizer, where tokenizer_config.json names it (no remote code): the class
    AutoTokenizer loads for it. A model-specific class is left to AutoTokenizer, which may load another class
    than the one named (transformers 5 loads its generic one for a LlamaTokenizerFast with a byte-level
    tokenizer.json) and reads the model's config to decide."""
    import transformers

    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        raw = json.load(f)
    name = raw.get("tokenizer_class") if isinstance(raw, dict) else None
    if name not in GENERIC or raw.get("auto_map"):
        return None
    return getattr(transformers, name, None)
