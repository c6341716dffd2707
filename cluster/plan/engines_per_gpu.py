"""How many engines share each GPU, and so how many actors a model gets, where the spec leaves `actors.count` or
`actors.num_gpus` out: chosen once Ray is up, from the cluster's GPUs, their memory and the models'
weights, and recorded with its reason in the manifest (`runs[].engines`) and the run's output.

The rule, measured on one H100 80GB (vLLM 0.26; bench/README.md, "Whole processes" and "lm-eval tasks"):
two engines on one GPU beat one engine as a whole process for a 136M and a 254M model (1.25x on lm-eval
tasks, 1.27x at 5,248 prompts), because a small model's one engine leaves the GPU idle between its steps. So:
- two engines per GPU where every model's weights take at most SMALL_WEIGHTS_BYTES, each engine spans one GPU,
  and the GPU has at least SHARED_GPU_MIN_BYTES (each engine then keeps tens of GiB for its KV cache);
- four engines per GPU where every model's weights take at most TINY_WEIGHTS_BYTES, the GPU has at least
  FOUR_ENGINES_MIN_BYTES, and the sweep asks for at least MANY_TOKENS_PER_GPU new tokens per GPU (its rows x
  max_tokens x n, per model): on an H200 with a 136M model, 5,248 prompts of 256 new tokens (1.34M) ran in
  43.5 s on four engines against 48.3 s on two (the plain script: 62.6 s), while 1,312 prompts (0.34M) took
  35.2 s on four and 33.7 s on two: four engines start as fast, but a small sweep's tail idles more of them
  (bench/records/h200-engines-per-gpu-and-pool-planning.md); on four H200s with the same model, 10,496 prompts
  (0.67M per GPU) ran in 48.9 s on four engines per GPU against 57.5 s on two (bench/records/4xh200-scale-out.md);
- for a larger model whose engines start uncompiled (cluster/contracts/engine_defaults.py starts_uncompiled: a
  sweep that asks it for no log-likelihood), one engine per GPU, with vLLM's batch for the whole GPU. On one H200
  with a model of Llama-3-8B's shape (13.2 GiB), 1,312 prompts of 256 new tokens, three rounds against the plain
  script on each of two machines, one engine generated faster than two engines of 256 sequences each in all six
  rounds (19.8-23.1 s from first shard to last against 23.1-25.0 s) and built as fast; its whole command was faster
  in four rounds (by 2.8-6.8 s) and slower in two (by 0.2 and 1.0 s): medians 1.10x against 1.01x the plain script
  on one machine, 1.13x against 1.11x on the other: an 8B model's step gains from the larger batch
  (bench/records/h200-8b-one-engine-or-two.md). Models between SMALL_WEIGHTS_BYTES and 8B were not measured either
  way;
- for a larger model whose engines start compiled (log-likelihoods asked, reproducible mode, or the spec's own
  compilation settings), two engines per GPU where each keeps at least PAIRED_KV_MIN_BYTES for its KV cache (half of
  90% of the GPU, less its weights with a fifth more and 3 GiB, as actors/vllm_args.py sizes a shared engine's
  cache): on one H200 with the same model, 1,312 prompts took 71.3 s on two compiled engines against 80.4 s on one
  (the plain script: 91.5 s): the two generated no faster (24.0 s against 23.8 s), but each started in 22-24 s
  against 31 s for one compiled engine with the whole GPU (bench/records/4xh200-8b-two-engines-and-loglikelihood.md).
  An H100 80GB would leave each of two engines 17 GiB: one engine there, not measured;
- one engine per GPU otherwise; a GPU of unknown memory is not shared;
- actors per model: engines per GPU x the GPUs the cluster has now, over the GPUs one engine spans (at least
  one: an autoscaled group at zero nodes starts with one);
- without GPUs (the CPU engine): one actor per model, as before;
- a value the spec gives is kept, and the other is chosen around it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.contracts.engine_defaults import starts_uncompiled
from cluster.contracts.model_memory import (DEFAULT_UTILIZATION, GIB, accelerator_memory, shared_kv_cache_bytes,
                                            weight_bytes)
from cluster.contracts.spec import ActorSpec, SweepSpec

SMALL_WEIGHTS_BYTES = 2 * GIB  # about 1B parameters in bf16: the largest model measured to gain is 254M
SHARED_GPU_MIN_BYTES = 40 * GIB  # a GPU two engines share: an A100-40G or larger
TINY_WEIGHTS_BYTES = GIB // 2  # about 250M parameters in bf16: four engines measured on a 136M model
FOUR_ENGINES_MIN_BYTES = 64 * GIB  # an H100 80GB or larger: each of four engines keeps over 15 GiB
MANY_TOKENS_PER_GPU = 500_000  # between 0.34M (four engines lost) and 0.67M (they won) measured
PAIRED_KV_MIN_BYTES = 40 * GIB  # a larger model's two engines on one GPU: each keeps this for its KV cache (44 GiB
# each for 8B on an H200 measured faster than one engine)


@dataclass(frozen=True)
class EngineChoice:
    count: int  # actors per model
    num_gpus: float  # each actor's share of a GPU
    engines_per_gpu: int
    reason: str

    def record(self) -> dict:
        return {"count": self.count, "num_gpus": self.num_gpus, "engines_per_gpu": self.engines_per_gpu,
                "reason": self.reason}


def choose(spec: SweepSpec, cluster_resources: dict, model_bytes=None, new_tokens: int | None = None) -> EngineChoice:
    """The actors' count and GPU share for `spec`. `cluster_resources`: ray.cluster_resources(); `model_bytes`:
    each model's weights in bytes, None where unknown (default: `model_weights(spec)`, read only when needed);
    `new_tokens`: the most new tokens the sweep asks of each model (cluster/inputs/data.py
    `generation_budget`), None where unknown."""
    actors = spec.actors
    gpus = int(cluster_resources.get("GPU", 0))
    if not gpus and actors.accelerator_type is None:
        return _kept(actors, 1, "no GPU in the cluster: one CPU engine per actor")
    if actors.num_gpus is not None:
        per_gpu = shares_per_gpu(actors.num_gpus)
        why = f"actors.num_gpus {actors.num_gpus:g} set in the spec"
        if actors.count is not None or not gpus:
            return _kept(actors, per_gpu, why)
        # as many as the cluster's GPUs hold now: shares packed per GPU, whole GPUs (or an engine's span) per actor
        span = max((m.gpus_per_engine for m in spec.models), default=1)
        count = max(per_gpu * (gpus // span) if actors.num_gpus < 1 else gpus // max(int(actors.num_gpus), span), 1)
        return EngineChoice(count, actors.num_gpus, per_gpu, f"{why}; {count} actor(s) per model for {gpus} GPU(s)")
    per_gpu, why = _engines_per_gpu(spec, cluster_resources, model_weights(spec) if model_bytes is None else model_bytes,
                                    new_tokens)
    span = max((m.gpus_per_engine for m in spec.models), default=1)  # an engine of N GPUs: one actor per N
    count = actors.count if actors.count is not None else per_gpu * max(gpus // span, 1)
    where = f"; {count} actor(s) per model" + ("" if actors.count is not None else f" for {max(gpus, 1)} GPU(s)")
    return EngineChoice(count, 1.0 / per_gpu, per_gpu, why + where)


def resolved(spec: SweepSpec, choice: EngineChoice) -> SweepSpec:
    """`spec` with its actors' count and share as chosen."""
    return replace(spec, actors=replace(spec.actors, count=choice.count, num_gpus=choice.num_gpus))


def model_weights(spec: SweepSpec) -> dict[str, int | None]:
    """Each model's weights in bytes at the dtype vLLM loads them in, where its config is at hand."""
    from cluster.inputs.builtin_model import find_model, is_builtin

    found = {}
    for model in spec.models:
        path = spec.model_path(model)
        try:
            config = find_model(path)
        except (OSError, ValueError):  # checked before Ray started: here only a size is wanted
            config = None
        found[model.name] = weight_bytes(None if is_builtin(path) else path, config, model.engine)
    return found


def _engines_per_gpu(spec: SweepSpec, cluster_resources: dict, model_bytes: dict[str, int | None],
                     new_tokens: int | None = None) -> tuple[int, str]:
    kind = spec.actors.accelerator_type or _accelerator(cluster_resources)
    memory = accelerator_memory(kind)
    if memory is None:
        return 1, f"one engine per GPU: the memory of a {kind or 'GPU of unknown type'} is not known to raysweep"
    if memory < SHARED_GPU_MIN_BYTES:
        return 1, f"one engine per GPU: one {kind} has {memory / GIB:.0f} GiB, under {SHARED_GPU_MIN_BYTES / GIB:.0f} GiB"
    spanning = [m for m in spec.models if m.gpus_per_engine > 1]
    if spanning:
        return 1, f"one engine per GPU: model {spanning[0].name}'s engine spans {spanning[0].gpus_per_engine} GPUs"
    unknown = [name for name, size in model_bytes.items() if size is None]
    if unknown:
        return 1, f"one engine per GPU: model {unknown[0]}'s size is not known before it loads"
    large = {name: size for name, size in model_bytes.items() if size > SMALL_WEIGHTS_BYTES}
    if large:
        name, size = max(large.items(), key=lambda item: item[1])
        kv = paired_kv_bytes(size, memory)
        model = next(m for m in spec.models if m.name == name)
        uncompiled = starts_uncompiled(model, size, spec.reproducible)
        engines = large_model_engines(size, memory, uncompiled)
        if uncompiled:
            return engines, (f"one engine per GPU: model {name}'s weights take {size / GIB:.1f} GiB, over "
                             f"{SMALL_WEIGHTS_BYTES / GIB:.0f} GiB, and its engines start uncompiled (no "
                             "log-likelihood asked of it): one engine's batch generates faster than two engines' on "
                             "one GPU")
        if engines == 2:
            return 2, (f"two engines per GPU: model {name}'s weights take {size / GIB:.1f} GiB, and a {kind} of "
                       f"{memory / GIB:.0f} GiB leaves each of two engines {kv / GIB:.0f} GiB for its KV cache (at least "
                       f"{PAIRED_KV_MIN_BYTES / GIB:.0f} GiB)")
        return 1, (f"one engine per GPU: model {name}'s weights take {size / GIB:.1f} GiB, over "
                   f"{SMALL_WEIGHTS_BYTES / GIB:.0f} GiB, and two engines would keep {max(kv, 0) / GIB:.0f} GiB each "
                   f"for their KV cache on a {kind} (under {PAIRED_KV_MIN_BYTES / GIB:.0f} GiB)")
    largest = max(model_bytes.values(), default=0)
    per_gpu_tokens = None if new_tokens is None else new_tokens / max(int(cluster_resources.get("GPU", 0)), 1)
    if largest <= TINY_WEIGHTS_BYTES and memory >= FOUR_ENGINES_MIN_BYTES and per_gpu_tokens is not None \
            and per_gpu_tokens >= MANY_TOKENS_PER_GPU:
        return 4, (f"four engines per GPU: the largest model's weights take {largest / GIB:.2f} GiB (at most "
                   f"{TINY_WEIGHTS_BYTES / GIB:.1f} GiB) on a {kind} of {memory / GIB:.0f} GiB, and the sweep asks "
                   f"up to {per_gpu_tokens / 1e6:.2f}M new tokens per GPU (at least {MANY_TOKENS_PER_GPU / 1e6:g}M)")
    return 2, (f"two engines per GPU: the largest model's weights take {largest / GIB:.2f} GiB (at most "
               f"{SMALL_WEIGHTS_BYTES / GIB:.0f} GiB) on a {kind} of {memory / GIB:.0f} GiB")


def paired_kv_bytes(weight_bytes: int, memory: int) -> int:
    """Each engine's KV cache where two share a GPU of `memory` bytes, as actors/vllm_args.py sizes it."""
    return shared_kv_cache_bytes(DEFAULT_UTILIZATION * memory / 2, weight_bytes)


def shares_per_gpu(num_gpus: float) -> int:
    """Actors per GPU where the spec gives each `num_gpus` (a fraction: as many as fit one GPU; else one)."""
    return max(1, int(1 / num_gpus)) if 0 < num_gpus < 1 else 1


def large_model_engines(weight_bytes: int, memory: int, uncompiled: bool) -> int:
    """Engines per GPU for a model over SMALL_WEIGHTS_BYTES on a GPU of `memory` bytes, its engines starting
    `uncompiled` or not (cluster/contracts/engine_defaults.py starts_uncompiled); also read by
    cluster/plan/early_engines.py, which builds as many early engines per GPU before Ray is up."""
    return 2 if not uncompiled and paired_kv_bytes(weight_bytes, memory) >= PAIRED_KV_MIN_BYTES else 1


def _accelerator(cluster_resources: dict) -> str | None:
    kinds = sorted(key.split(":", 1)[1] for key in cluster_resources if key.startswith("accelerator_type:"))
    return kinds[0] if len(kinds) == 1 else None


def _kept(actors: ActorSpec, per_gpu: int, reason: str) -> EngineChoice:
    count = actors.count if actors.count is not None else 1
    num_gpus = actors.num_gpus if actors.num_gpus is not None else 1.0
    return EngineChoice(count, num_gpus, per_gpu, reason)
