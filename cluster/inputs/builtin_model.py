"""`builtin:tiny` (and larger shapes for benchmarks): a Llama-architecture causal LM built locally, no downloads.

The weights are random (seeded numpy PCG64), so its answers are noise: it exists so that a whole sweep,
structured decoding included, runs on a laptop, in CI and on a GPU under vLLM. Everything is written in
standard Hugging Face form (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and
built deterministically: two builds are byte-identical. Building needs numpy, safetensors and tokenizers,
not torch.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from cluster.contracts.hub import hub_unreachable
from cluster.contracts.model_paths import BUILTIN_PREFIX, cache_root, is_builtin, is_local_path  # noqa: F401

VERSION = "v1"  # bump when the recipe changes: the cache directory is keyed by it

# Byte-level vocabulary: ids 0-255 are the bytes, then these special tokens, in this order.
SPECIAL_TOKENS = ("<|end|>", "<|pad|>", "<|bos|>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|reserved_0|>", "<|reserved_1|>")
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

CONFIGS = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32768, seed=20261121),
    # ~135M parameters: big enough that a GPU benchmark measures the GPU, not Python overhead
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=4, max_position_embeddings=32768, seed=20261122),
    # ~1B parameters (TinyLlama's shape): a GPU step as long as a real small model's, for benchmarks
    "medium": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                   num_key_value_heads=4, max_position_embeddings=32768, seed=20261123),
    # ~7B parameters (Llama-3-8B's shape, byte vocabulary): the step time of a model teams evaluate.
    # GPU benchmarks only: uniform weights (normal draws for 7B values take minutes), stored as float16
    "large": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=32768, seed=20261124,
                  init="uniform", storage="float16"),
}


def resolve_model_path(path: str) -> str:
    """A local directory or hub id as given; `builtin:NAME` built (once) into the cache."""
    if not is_builtin(path):
        return path
    name, target = _builtin_target(path)
    if not (target / "model.safetensors").exists():
        say_building(path, target)
        build(name, target)
    return str(target)


def built_path(path: str) -> str | None:
    """What resolve_model_path gives where it has nothing to build; None for a builtin model not built yet."""
    if not is_builtin(path):
        return path
    _, target = _builtin_target(path)
    return str(target) if (target / "model.safetensors").exists() else None


def _builtin_target(path: str) -> tuple[str, Path]:
    name = path[len(BUILTIN_PREFIX):]
    if name not in CONFIGS:
        raise ValueError(f"{path}: unknown builtin model; known: {', '.join(BUILTIN_PREFIX + n for n in CONFIGS)}")
    return name, cache_root() / f"builtin-{name}-{VERSION}"


def say_building(path: str, target: Path) -> None:
    """One line while a builtin model is built (seconds for tiny, about a minute for small, minutes for large),
    so that its first use is not a silence. On stderr: on a terminal the line under the progress bar (stdout)
    is cleared first, so the two do not run into each other."""
    lead = "\r\x1b[K" if sys.stderr.isatty() else ""
    print(f"{lead}[raysweep] building {path} (first use; cached under {target})", file=sys.stderr, flush=True)


# any of these makes a folder a tokenizer's (fast, slow, sentencepiece, BPE and WordPiece vocabularies)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt", "tiktoken.model")


def find_model(path: str) -> dict | None:
    """Where a model is, found without loading it (cheap: it runs before Ray starts). Raises ValueError
    saying why it cannot be there; returns its config.json where that is at hand (builtin, a local
    directory, the Hugging Face cache), else None: a hub id that loading will download.
    A path is local by `is_local_path`, or where it exists; else it is a hub id (`name` or `org/name`), as
    Hugging Face reads it. A spec's model paths reach here resolved from the spec's folder
    (SweepSpec.model_path); `~` is expanded here too. A local directory must hold config.json and a
    tokenizer's files (the tokenizer is loaded after Ray starts: its absence is caught now)."""
    if is_builtin(path):
        name = path[len(BUILTIN_PREFIX):]
        if name not in CONFIGS:
            raise ValueError(f"unknown builtin model; known: {', '.join(BUILTIN_PREFIX + n for n in CONFIGS)}")
        return builtin_config(name)
    path = os.path.expanduser(path)
    if is_local_path(path) or path.startswith(".") or os.path.exists(path):
        if not os.path.exists(path):
            raise ValueError("no such directory")
        if not os.path.isdir(path):
            raise ValueError("not a directory (a model is a directory holding config.json and weights)")
        config = _config(os.path.join(path, "config.json"))
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer files in {path} (tokenizer.json, tokenizer_config.json, tokenizer.model "
                             "or vocab files): not a complete Hugging Face model directory")
        return config
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id=path, filename="config.json")
    except ValueError:  # huggingface_hub's HFValidationError: not an `org/name` id
        raise ValueError("no such directory, and not a hub id (`name` or `org/name`)") from None
    if isinstance(cached, str):
        return _config(cached)
    offline = hub_unreachable()
    if offline:
        raise ValueError(f"not a local directory, not in the Hugging Face cache, and the hub cannot be reached "
                         f"({offline})")
    return None


def _config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no config.json in {os.path.dirname(path)}: not a Hugging Face model directory") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON config: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def build(name: str, target: Path) -> None:
    """Write the model into `target` atomically: build in a sibling temp dir, then rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_model(name, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same build first; its copy is identical
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def builtin_config(name: str) -> dict:
    """The config.json of builtin model `name` (a key of CONFIGS), without building it."""
    cfg = CONFIGS[name]
    vocab_size = 256 + len(SPECIAL_TOKENS)
    end_id, pad_id, bos_id = 256, 257, 258
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"],
        "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": bos_id, "eos_token_id": end_id, "pad_token_id": pad_id,
        "torch_dtype": "bfloat16",  # vLLM runs it in bf16; the CPU engine loads it as float32
    }


def _write_model(name: str, out: Path) -> None:
    cfg, config = CONFIGS[name], builtin_config(name)
    end_id, pad_id, bos_id = config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": end_id, "pad_token_id": pad_id}, indent=2, sort_keys=True) + "\n")
    _write_weights(config, cfg["seed"], out / "model.safetensors", cfg.get("init", "normal"),
                   np.dtype(cfg.get("storage", "float32")))
    _write_tokenizer(out)


def _write_weights(config: dict, seed: int, path: Path, init: str, storage: np.dtype) -> None:
    from safetensors.numpy import save_file

    save_file(weight_tensors(config, seed, init, storage), str(path), metadata={"format": "pt"})


def weight_tensors(config: dict, seed: int, init: str, storage: np.dtype) -> dict[str, np.ndarray]:
    """The model's weights by Hugging Face Llama name, drawn from `seed` in one fixed order."""
    rng = np.random.Generator(np.random.PCG64(seed))
    h, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    std = config["initializer_range"]

    def normal(*shape: int) -> np.ndarray:
        if init == "uniform":  # same standard deviation: U(-a, a) has std a / sqrt(3)
            w = rng.random(shape, dtype=np.float32)
            w -= 0.5
            w *= 2 * std * np.sqrt(3.0, dtype=np.float32)
            return w.astype(storage)
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(storage)

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(h, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, h)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, inter)
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=storage)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=storage)
    tensors["model.norm.weight"] = np.ones(h, dtype=storage)
    return tensors


def _write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins GPT-2 uses for bytes
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
        "bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"}, indent=2, sort_keys=True) + "\n")


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable latin-1 bytes map to themselves, the rest to 256+n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]
