"""Probe: does reading a checkpoint while vLLM imports shorten `LLM(...)`? One process, one engine, timed from its start.

    python -m benchmarks.weights_probe default|preloaded MODEL_DIR

- `default`: `import vllm`, then `LLM(model=MODEL_DIR, ...)` reads the safetensors files itself, file after file;
- `preloaded`: a thread reads every safetensors file of MODEL_DIR into memory while `import vllm` runs; the tensors
  are views of what it read (`torch.frombuffer`), handed to the model by a loader registered for the call
  (`register_model_loader`, `load_format="raysweep_preloaded"`), which calls `model.load_weights` on them.

Both start the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), uncompiled with full decode graphs as
raysweep starts a large model, and generate 32 greedy tokens for 8 prompts. Prints `PROBE` lines: when the read and
the import ended, `LLM(...)`'s seconds, when the engine was ready, and a digest of the outputs (the same weights give
the same digest); vLLM's own start-up report (INFO) says how long the weights took to load.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import threading
import time

STARTED = time.perf_counter()
UNCOMPILED = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def read_all(folder: str, into: dict) -> None:
    """Every safetensors file of `folder`, as (header, bytes), into `into` by file."""
    began = time.perf_counter()
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            size = os.path.getsize(path) - 8 - n
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                got += f.readinto(view[got:])
        into[path] = (header, data)
    print(f"PROBE read_s {time.perf_counter() - began:.2f} done_at {_since_start()}", flush=True)


def tensors_of(read: dict) -> dict:
    """Each tensor of what read_all read, by name, as a view of its bytes."""
    import torch

    dtypes = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
    out = {}
    for header, data in read.values():
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            dtype = dtypes[meta["dtype"]]
            out[name] = torch.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize,
                                         offset=start).view(meta["shape"])
    return out


def register_preloaded(tensors: dict) -> str:
    """A vLLM load format whose loader hands `tensors` to the model; its name."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("raysweep_preloaded")
    class Preloaded(BaseModelLoader):
        def download_model(self, model_config) -> None:
            pass

        def load_weights(self, model, model_config) -> None:
            began = time.perf_counter()
            model.load_weights(iter(tensors.items()))
            print(f"PROBE preloaded load_weights_s {time.perf_counter() - began:.2f}", flush=True)

    return "raysweep_preloaded"


def main(mode: str, folder: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    read: dict = {}
    reader = threading.Thread(target=read_all, args=(folder, read)) if mode == "preloaded" else None
    if reader:
        reader.start()
    from vllm import LLM, SamplingParams

    print(f"PROBE import_done_at {_since_start()}", flush=True)
    args = {"model": folder, "seed": 0, "compilation_config": UNCOMPILED}
    if reader:
        reader.join()
        print(f"PROBE joined_at {_since_start()}", flush=True)
        args["load_format"] = register_preloaded(tensors_of(read))
    began = time.perf_counter()
    llm = LLM(**args)
    print(f"PROBE llm_s {time.perf_counter() - began:.2f} ready_at {_since_start()}", flush=True)
    outputs = llm.generate([f"Question {i}: the rain in the hills" for i in range(8)],
                           SamplingParams(max_tokens=32, temperature=0))
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    print("PROBE outputs", hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16], ids[0][:8], flush=True)
    print(f"PROBE end_at {_since_start()}", flush=True)
    os._exit(0)  # the engine's threads are not waited for: the probe is over


def _since_start() -> str:
    return f"{time.perf_counter() - STARTED:.2f}"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("default", "preloaded"):
        sys.exit("usage: python -m benchmarks.weights_probe default|preloaded MODEL_DIR")
    main(sys.argv[1], sys.argv[2])
