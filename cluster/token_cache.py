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

from cluster.builtin_model import cache_root


def fingerprint(tokenizer) -> str:
    """Identifies the tokenization: the fast tokenizer's full definition, or the slow one's vocab."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def prompt_keys(prompts: list[str], add_special_tokens: bool) -> list[bytes]:
    flag = b"1" if add_special_tokens else b"0"
    return [hashlib.blake2b(flag + p.encode("utf-8", "surrogatepass"), digest_size=16).digest() for p in prompts]


class TokenCache:
    def __init__(self, tokenizer, root: Path | None = None):
        self.folder = (root or cache_root() / "tokens") / fingerprint(tokenizer)
        self._known: dict[bytes, int] | None = None
        self.hits = self.misses = 0

    def lengths(self, prompts: list[str], add_special_tokens: bool, count) -> np.ndarray:
        """Token counts of `prompts`; `count(list_of_prompts) -> counts` measures the ones not cached."""
        keys = prompt_keys(prompts, add_special_tokens)
        known = self._load()
        out = np.fromiter((known.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        missing = np.flatnonzero(out < 0)
        self.hits, self.misses = len(keys) - len(missing), len(missing)
        if len(missing):
            counted = np.asarray(count([prompts[i] for i in missing]), dtype=np.int64)
            out[missing] = counted
            new_keys = [keys[i] for i in missing]
            known.update(zip(new_keys, counted.tolist()))
            self._save(new_keys, counted)
        return out

    def _load(self) -> dict[bytes, int]:
        if self._known is None:
            self._known = {}
            for part in sorted(self.folder.glob("part-*.parquet")) if self.folder.exists() else []:
                table = pq.read_table(part)
                self._known.update(zip(table["key"].to_pylist(), table["tokens"].to_pylist()))
        return self._known

    def _save(self, keys: list[bytes], counts: np.ndarray) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex}.parquet"
        tmp = self.folder / f".{name}.tmp"
        pq.write_table(pa.table({"key": pa.array(keys, pa.binary(16)), "tokens": pa.array(counts, pa.int32())}), tmp)
        os.replace(tmp, self.folder / name)
