"""Prompt lengths in tokens, cached per (tokenizer, prompt hash), so planning a sweep again is cheap.

The cache for one tokenizer is a folder of Parquet parts (key: 16-byte blake2b of the prompt and the
add-special-tokens flag; tokens: int32) under ~/.cache/raysweep/tokens/<tokenizer fingerprint>/. Each
planning run that tokenized something new adds one part, written atomically; parts are only read and
added, so concurrent planners can share the cache.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cluster.inputs.builtin_model import cache_root


def fingerprint(tokenizer) -> str:
    """Identifies the tokenization: a lazily loaded tokenizer's files (cluster/inputs/model_files.py), else
    the fast tokenizer's full definition, or the slow one's vocab."""
    from cluster.inputs.model_files import LazyTokenizer

    if isinstance(tokenizer, LazyTokenizer):
        return tokenizer.fingerprint
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def measured_before(fingerprint: str, root: Path | None = None) -> bool:
    """Whether this tokenizer has counted prompts into the cache before (so it loaded then)."""
    folder = (root or cache_root() / "tokens") / fingerprint
    return folder.is_dir() and any(folder.glob("part-*.parquet"))


def prompt_keys(prompts: list[str], add_special_tokens: bool) -> list[bytes]:
    flag = b"1" if add_special_tokens else b"0"
    return [hashlib.blake2b(flag + p.encode("utf-8", "surrogatepass"), digest_size=16).digest() for p in prompts]


class TokenCache:
    """Lookups are vectorised over sorted numpy arrays (a 16-byte key and an int64 count per cached
    prompt, not a dict entry); new counts are written as one part by `flush()`."""

    def __init__(self, tokenizer, root: Path | None = None):
        self.folder = (root or cache_root() / "tokens") / fingerprint(tokenizer)
        self._keys: np.ndarray | None = None  # (n, 2) uint64, sorted by the first column
        self._tokens: np.ndarray | None = None
        self._new_keys: list[np.ndarray] = []  # (n, 2) uint64 each: the 16-byte keys
        self._new_tokens: list[np.ndarray] = []
        self.hits = self.misses = 0

    def lengths(self, prompts: list[str], add_special_tokens: bool, count) -> np.ndarray:
        """Token counts of `prompts`; `count(list_of_prompts) -> counts` measures the ones not cached."""
        keys = np.frombuffer(b"".join(prompt_keys(prompts, add_special_tokens)), dtype=np.uint64).reshape(-1, 2)
        out = self._lookup(keys)
        missing = np.flatnonzero(out < 0)
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if len(missing):
            counted = np.asarray(count([prompts[i] for i in missing]), dtype=np.int64)
            out[missing] = counted
            self._new_keys.append(keys[missing])
            self._new_tokens.append(counted)
        return out

    def flush(self) -> None:
        """Write what was counted since the last flush as one part (atomically)."""
        if not self._new_keys:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex}.parquet"
        tmp = self.folder / f".{name}.tmp"
        keys = np.ascontiguousarray(np.concatenate(self._new_keys))
        key_column = pa.Array.from_buffers(pa.binary(16), len(keys), [None, pa.py_buffer(keys.tobytes())])
        pq.write_table(pa.table({"key": key_column,
                                 "tokens": pa.array(np.concatenate(self._new_tokens), pa.int32())}), tmp)
        os.replace(tmp, self.folder / name)
        self._new_keys, self._new_tokens = [], []

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        known, tokens = self._load()
        out = np.full(len(keys), -1, dtype=np.int64)
        if len(known) == 0 or len(keys) == 0:
            return out
        at = np.minimum(np.searchsorted(known[:, 0], keys[:, 0]), len(known) - 1)
        hit = (known[at, 0] == keys[:, 0]) & (known[at, 1] == keys[:, 1])
        out[hit] = tokens[at[hit]]
        return out

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        if self._keys is None:
            keys, tokens = [np.empty((0, 2), np.uint64)], [np.empty(0, np.int64)]
            for part in sorted(self.folder.glob("part-*.parquet")) if self.folder.exists() else []:
                table = pq.read_table(part)
                raw = table["key"].combine_chunks().buffers()[1]  # fixed-size binary(16): the key bytes
                keys.append(np.frombuffer(raw, dtype=np.uint64, count=2 * table.num_rows).reshape(-1, 2))
                tokens.append(table["tokens"].to_numpy().astype(np.int64))
            all_keys, all_tokens = np.concatenate(keys), np.concatenate(tokens)
            order = np.argsort(all_keys[:, 0], kind="stable")
            self._keys, self._tokens = all_keys[order], all_tokens[order]
        return self._keys, self._tokens
