"""Does a model's weights fit the GPUs it is given? Checked before any engine starts.

A model's weights at the dtype vLLM loads them in: the parameters counted from its safetensors headers
(exact: a read of each file's header) or, without weight files at hand, from its config.json
(the Llama family's shapes: embeddings, attention, MLP or experts, norms, an untied head), times the
dtype's bytes; a quantized checkpoint is counted as its files' bytes. Each GPU holds
1 / (tensor_parallel_size x pipeline_parallel_size) of them, and must keep room beside them:
vLLM takes `gpu_memory_utilization` (0.9) of the GPU, and the CUDA context, activations and a KV cache
need at least RESERVE_BYTES more. Checked twice: by the driver before Ray starts, where the spec names an
`accelerator_type` (ACCELERATOR_MEMORY: what NVML reports for that card), and by each actor before its
engine starts, against the memory NVML reports for its own GPU.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
RESERVE_BYTES = 1 * GIB  # beside the weights: CUDA context, activations, the smallest useful KV cache
DEFAULT_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization when the spec gives none
MAX_TP = 16
SHARED_MARGIN_BYTES = 3 * GIB  # beside a shared engine's weights: CUDA context, activations, graphs, sampler
# total memory as NVML reports it, by Ray's accelerator type names (ray.util.accelerators)
ACCELERATOR_MEMORY = {
    "T4": 15360 * MIB, "L4": 23034 * MIB, "A10G": 23028 * MIB, "L40S": 46068 * MIB, "V100": 16384 * MIB,
    "A100": 40960 * MIB, "A100-40G": 40960 * MIB, "A100-80G": 81920 * MIB, "H100": 81559 * MIB,
    "H200": 143771 * MIB, "B200": 183359 * MIB,
}
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8": 1, "fp8": 1,
               "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


@dataclass(frozen=True)
class Weights:
    parameters: int | None  # None for a quantized checkpoint (counted in bytes)
    bytes: int
    dtype: str  # what vLLM loads them as, or "as stored" (quantized)

    def show(self) -> str:
        count = f"{self.parameters / 1e9:.2f}B parameters, " if self.parameters else ""
        return f"{self.bytes / GIB:.1f} GiB ({count}{self.dtype})"


def load_dtype(engine: dict, config: dict) -> str:
    """What vLLM loads the weights as: the spec's `dtype`, else the checkpoint's; `auto` on a float32
    checkpoint is half precision (vLLM's own rule), as is a checkpoint that names none."""
    asked = engine.get("dtype", "auto")
    if isinstance(asked, str) and asked != "auto":
        return asked
    stored = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return "bfloat16" if stored in ("float32", "float") else stored


def weights(path: str | None, config: dict, engine: dict) -> Weights | None:
    """The model's weights as loaded (see the module's doc), or None where neither its files nor its
    config say enough."""
    dtype = load_dtype(engine, config)
    files = weight_files(path) if path and os.path.isdir(path) else []
    if config.get("quantization_config") or engine.get("quantization"):
        stored = sum(f.stat().st_size for f in files)
        return Weights(None, stored, "as stored, quantized") if stored else None
    count = sum(_safetensors_parameters(f) for f in files) if files else config_parameters(config)
    if not count or dtype not in DTYPE_BYTES:
        return None
    return Weights(count, count * DTYPE_BYTES[dtype], dtype)


def folder_config(path: str) -> dict | None:
    """A model folder's config.json, None where it cannot be read or is no mapping (vLLM then says what is wrong
    with the model itself)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def weight_bytes(path: str | None, config: dict | None, engine: dict) -> int | None:
    """`weights`' bytes where only a size is wanted (the engines per GPU, the early engines): None where its
    files or config do not say, or cannot be read (`path` None: no files, as for a builtin model)."""
    try:
        counted = config and weights(path, config, engine)
    except (OSError, ValueError):
        counted = None
    return counted.bytes if counted else None


def weight_files(path: str) -> list[Path]:
    """The safetensors files vLLM loads from a model folder: those its index names where there is one
    (Mistral's folders hold `consolidated.safetensors` beside the same weights in shards: one set is loaded),
    else all of them but a `consolidated` copy beside other files."""
    files = sorted(Path(path).glob("*.safetensors"))
    index = Path(path) / "model.safetensors.index.json"
    try:
        named = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else None
    except (OSError, ValueError, KeyError, AttributeError):
        named = None
    if named:
        return [f for f in files if f.name in named]
    sharded = [f for f in files if not f.name.startswith("consolidated")]
    return sharded or files


SAFETENSORS_HEADER_MAX = 100_000_000  # the format's own bound on its JSON header (safetensors' MAX_HEADER_SIZE)


def _safetensors_parameters(path: Path) -> int:
    """Parameters in one safetensors file, from its header (`safetensors_tensors`)."""
    return sum(math.prod(shape) for shape in safetensors_tensors(path).values())


def safetensors_tensors(path: Path) -> dict[str, list[int]]:
    """Each tensor's name and shape in one safetensors file, from its JSON header (8 bytes of length, then the
    header). A file that is not one (a header length past the file's end or the format's bound, a header that is
    no tensor table) raises ValueError, before anything of that length is read."""
    with open(path, "rb") as f:
        start = f.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else -1
        if not 0 < length <= min(SAFETENSORS_HEADER_MAX, os.fstat(f.fileno()).st_size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    try:
        return {name: list(t["shape"]) for name, t in header.items() if name != "__metadata__"}
    except (AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a safetensors header ({type(e).__name__}: {e})") from None


# config keys of shapes the formula does not know (DeepSeek's latent attention and routed experts, among
# others): such a model is not counted from its config (no check) rather than counted wrong
UNKNOWN_SHAPES = ("kv_lora_rank", "q_lora_rank", "n_routed_experts", "first_k_dense_replace", "mlp_only_layers")


def config_parameters(config: dict) -> int | None:
    """Parameters of a Llama-family decoder from its config.json (Mistral, Qwen, Mixtral- and Qwen-MoE-style
    experts alike, biases left out); None where a size it needs is missing or a shape it does not know
    (UNKNOWN_SHAPES) is there."""
    try:
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        heads = config["num_attention_heads"]
        inter = config["intermediate_size"]
    except KeyError:
        return None
    if any(config.get(key) for key in UNKNOWN_SHAPES) or config.get("decoder_sparse_step", 1) != 1:
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    experts = config.get("num_local_experts") or config.get("num_experts") or 1
    attention = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
    if experts > 1:
        # Qwen-MoE's experts are moe_intermediate_size wide (intermediate_size is the dense size); Mixtral's
        # are intermediate_size; a router per layer, and Qwen2-MoE's shared expert with its gate
        expert = config.get("moe_intermediate_size") or inter
        shared = config.get("shared_expert_intermediate_size") or 0
        mlp = 3 * hidden * expert * experts + hidden * experts + (3 * hidden * shared + hidden if shared else 0)
    else:
        mlp = 3 * hidden * inter
    head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden + head


def shared_kv_cache_bytes(share_bytes: float, weight_bytes: int) -> int:
    """The KV cache of an engine that shares its GPU, sized from its share of the GPU's memory in bytes: less its
    weights with a fifth more and SHARED_MARGIN_BYTES (actors/vllm_args.py gives it to the engine; the planner's
    engines-per-GPU rule reads it)."""
    return int(share_bytes - 1.2 * weight_bytes - SHARED_MARGIN_BYTES)


def accelerator_memory(accelerator_type: str | None) -> int | None:
    """Bytes of memory of a GPU of this Ray accelerator type, where it is a known one."""
    if not accelerator_type:
        return None
    return ACCELERATOR_MEMORY.get(accelerator_type) or ACCELERATOR_MEMORY.get(accelerator_type.upper())


def refusal(model_name: str, engine: dict, found: Weights, gpu_bytes: int, gpu_label: str,
            gpu_share: float = 1.0, heads: int | None = None) -> str | None:
    """Why `found` cannot fit the GPUs an engine of `engine`'s parallel sizes gets, with the smallest
    tensor_parallel_size that would fit; None where it fits. `gpu_share`: the fraction of a GPU a
    one-GPU engine gets (actors.num_gpus below 1)."""
    tensor, pipeline = engine.get("tensor_parallel_size", 1), engine.get("pipeline_parallel_size", 1)
    utilization = engine.get("gpu_memory_utilization", DEFAULT_UTILIZATION)
    share = min(gpu_share, 1.0) if tensor * pipeline == 1 else 1.0  # more GPUs than its engine spans: unused
    offload = float(engine.get("cpu_offload_gb") or 0) * GIB  # vLLM keeps this much of each GPU's weights in CPU memory

    def room(tp: int) -> float:
        return utilization * share * gpu_bytes - RESERVE_BYTES - max(found.bytes / (tp * pipeline) - offload, 0)

    if room(tensor) >= 0:
        return None
    usable = utilization * share * gpu_bytes - RESERVE_BYTES
    fitting = next((tp for tp in (1, 2, 4, 8, 16) if tp * pipeline <= MAX_TP and (not heads or heads % tp == 0)
                    and room(tp) >= 0), None)
    advice = (f"engine.tensor_parallel_size {fitting} is the smallest that fits" if fitting else
              f"no tensor_parallel_size up to {MAX_TP // pipeline} fits: use more pipeline_parallel_size or a larger GPU")
    shared = f" ({share:g} of it)" if share < 1 else ""
    offloaded = f" ({offload / GIB:g} GiB of them offloaded to CPU memory)" if offload else ""
    return (f"model {model_name}: its weights take {found.show()}; with tensor_parallel_size {tensor} and "
            f"pipeline_parallel_size {pipeline} each GPU holds {found.bytes / (tensor * pipeline) / GIB:.1f} GiB"
            f"{offloaded}, and "
            f"{gpu_label}{shared} has {gpu_bytes * share / GIB:.1f} GiB, of which vLLM uses {utilization:g} less "
            f"{RESERVE_BYTES / GIB:g} GiB for activations and the KV cache: {max(usable, 0) / GIB:.1f} GiB. {advice}")
