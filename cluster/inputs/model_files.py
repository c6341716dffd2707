"""What the driver reads of a model folder: its tokenizer and its context length, without importing torch.

`AutoTokenizer` and `AutoConfig` import transformers' model configuration code, and with it torch: 9.8 of a
10.7 s plan of 1,312 prompts on this 2-core machine, and 11 s of planning before a warm pool's first shard on
an H200 machine (bench/records/h200-engines-per-gpu-and-pool-planning.md). The driver needs neither torch nor a model: a folder whose
tokenizer_config.json names transformers' generic fast tokenizer (`PreTrainedTokenizerFast`, as the builtin
models and Llama 3 do; no remote code) gets that class directly, which imports no torch; its context length
is read from config.json. Anything else (another class, remote code, a hub id) goes through AutoTokenizer,
as before.

For those folders the tokenizer's identity is known without loading it (`files_fingerprint`: its files and
the versions of the code that reads them), so a sweep whose prompts were all measured before (the token
cache, cluster/inputs/token_cache.py) loads no tokenizer at all (`LazyTokenizer`): on an H200 machine whose
transformers imports torch, loading it was 5.5 s of a warm pool sweep's 7.1 s of planning
(bench/records/h200-warm-pool-and-lm-eval-ray-start.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Callable

from cluster.contracts.checkpoint import TOKENIZER_FILES  # what a fast tokenizer reads of a local folder

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


def files_fingerprint(path: str) -> str | None:
    """For a local folder whose tokenizer is transformers' generic fast one: a digest of its tokenizer files
    and of the transformers and tokenizers versions that read them (the same files read by the same code
    tokenize the same); None for any other tokenizer, which is identified by loading it."""
    if _generic_name(path) is None:
        return None
    readers = _reader_versions()
    if readers is None:
        return None
    digest = hashlib.sha256(readers.encode())
    for name in TOKENIZER_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                digest.update(f"{name} {os.path.getsize(file)}\n".encode() + f.read())
    return "files-" + digest.hexdigest()[:24]


@functools.cache
def _reader_versions() -> str | None:
    """The transformers and tokenizers versions, read once (importlib.metadata parses a package's METADATA
    file at each call: 1.3 ms)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "".join(f"{package} {version(package)}\n" for package in ("transformers", "tokenizers"))
    except PackageNotFoundError:
        return None


class LazyTokenizer:
    """A model folder's tokenizer, loaded on first use (`get()`, or any attribute or call, passed through),
    with its `files_fingerprint` known before. `on_error` turns a load error into the caller's own error."""

    def __init__(self, path: str, fingerprint: str, on_error=None, loaded=None):
        self.path, self.fingerprint, self._on_error, self._tokenizer = path, fingerprint, on_error, loaded

    def get(self):
        if self._tokenizer is None:
            try:
                self._tokenizer = load_tokenizer(self.path)
            except Exception as e:
                if self._on_error is None:
                    raise
                raise self._on_error(e) from None
        return self._tokenizer

    def __getattr__(self, name: str):  # only for names this class does not have
        if name.startswith("__") or name in ("path", "fingerprint", "_on_error", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self.get(), name)

    def __call__(self, *args, **kwargs):
        return self.get()(*args, **kwargs)


def unwrapped(tokenizer):
    """The loaded tokenizer itself, for code that checks its type (xgrammar)."""
    return tokenizer.get() if isinstance(tokenizer, LazyTokenizer) else tokenizer


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
    name = _generic_name(path)
    if name is None:
        return None
    import transformers

    return getattr(transformers, name, None)


def _generic_name(path: str) -> str | None:
    """The generic fast tokenizer's class name, where the folder's tokenizer_config.json names it (no remote
    code); read without importing transformers."""
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        raw = json.load(f)
    name = raw.get("tokenizer_class") if isinstance(raw, dict) else None
    if name not in GENERIC or raw.get("auto_map"):
        return None
    return name


def tokenizer_and_length(path: str, max_model_len: int | None) -> tuple[Callable[[], Any], int | None]:
    """A model's tokenizer, to load when it is asked for (`load_tokenizer` of its folder: a builtin model built, a hub
    id as it is), and its length: `max_model_len` where its engines are given one, else its files' (None where they
    do not say)."""
    from cluster.inputs.builtin_model import resolve_model_path

    folder = resolve_model_path(path)
    try:
        length = max_model_len or context_length(folder)
    except Exception:  # noqa: BLE001  (a hub id not in the cache, a config of its own kind)
        length = None
    return functools.partial(load_tokenizer, folder), length


def chat_tokenizer(models, base_dir: str):
    """The tokenizer whose chat template renders a `lm_eval:` entry's requests (cluster/lm_eval/requests.py):
    every model's template must be the same text (the requests are built once, for all of them)."""
    from cluster.inputs.builtin_model import resolve_model_path

    tokenizers = []
    for model in models:
        path = os.path.expanduser(model.path)
        local = os.path.normpath(os.path.join(base_dir, path))
        tokenizers.append(load_tokenizer(resolve_model_path(local if os.path.exists(local) else path)))
    # a template, or several by name (a dict, transformers' reading of a list of named ones): compared as JSON
    templates = {json.dumps(getattr(t, "chat_template", None), sort_keys=True) for t in tokenizers}
    if "null" in templates:
        raise ValueError("apply_chat_template: a model's tokenizer has no chat template")
    if len(templates) > 1:
        raise ValueError("apply_chat_template: the sweep's models have different chat templates; lm-eval requests "
                         "rendered with one would be wrong for the others (give each its own sweep)")
    return tokenizers[0]
