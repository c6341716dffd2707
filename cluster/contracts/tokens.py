"""Token ids and counts of prompts, the same way on the driver (planning measures) and on an actor (the
engine's input is checked against the planned count)."""

from __future__ import annotations

TOKENIZE_BATCH = 8192


def _encodings(prompts: list[str], tokenizer, add_special_tokens: bool):
    """Encodings from a fast tokenizer's Rust backend, called directly: the same ids as `tokenizer(...)`
    without transformers' per-encoding Python conversion; `encode_batch_fast` also skips offsets.
    None where the tokenizer has no Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return (e for start in range(0, len(prompts), TOKENIZE_BATCH)
            for e in encode(prompts[start:start + TOKENIZE_BATCH], add_special_tokens=add_special_tokens))


def tokenize(prompts: list[str], tokenizer, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of every prompt, in batches."""
    encodings = _encodings(prompts, tokenizer, add_special_tokens)
    if encodings is not None:
        return [e.ids for e in encodings]
    return tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]


def count_tokens(prompts: list[str], tokenizer, add_special_tokens: bool) -> list[int]:
    """Token counts of every prompt (no id lists built where the Rust backend is there)."""
    encodings = _encodings(prompts, tokenizer, add_special_tokens)
    if encodings is not None:
        return [len(e) for e in encodings]
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]]
