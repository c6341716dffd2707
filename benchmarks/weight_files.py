"""A model's weights written as Hugging Face's `save_pretrained` writes them: one safetensors file, or files of at
most a shard's size with an index, so that a benchmark's checkpoint is read as a real one of its size is."""

from __future__ import annotations

import json
from pathlib import Path

# save_pretrained's default shard size: Llama-3-8B's 16 GB of weights come as four files, the `large` shape's 14.2 GB
# here as three (vLLM reads a checkpoint file by file, and can read several files at once on threads)
MAX_SHARD_BYTES = 5 * 10**9


def write_weight_files(out: Path, tensors: dict, max_shard_bytes: int) -> list[Path]:
    """`tensors` as `save_pretrained` writes them: one `model.safetensors` where they fit in `max_shard_bytes`, or
    else files of at most that size (a tensor larger alone in its own), `model-0000K-of-0000N.safetensors`, in
    order, with `model.safetensors.index.json` last (its presence says the model is whole)."""
    from safetensors.numpy import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return [out / "model.safetensors"]
    files = [out / f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    for path, shard in zip(files, shards):
        save_file(shard, str(path), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": {name: path.name for path, shard in zip(files, shards) for name in shard}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def has_weights(model: Path) -> bool:
    """Whether write_weight_files finished writing `model`'s weights (its last file is there)."""
    return (model / "model.safetensors").exists() or (model / "model.safetensors.index.json").exists()
