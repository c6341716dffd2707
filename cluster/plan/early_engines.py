"""The engines a local run asks its engine host for before Ray is up (cluster/contracts/engine_host.py, "Early
engines"): one per actor, each the engine that actor will start first, built while Ray and the actors start.

On four H200s with a model of Llama-3-8B's shape, Ray was up 20 s after the command started and the host had
imported vLLM at 23 s; built early from then, the four engines were ready 52-59 s after the command started,
against about 72 s for four plain scripts started at once (bench/records/4xh200-early-engines.md). On one H200
the same model's two engines (two actors sharing the GPU), built early and at once (and uncompiled:
actors/vllm_args.py UNCOMPILED), were ready 36-42 s after the command started, against 38-40 s for a plain script's
one (bench/records/h200-8b-start-without-compile.md). An engine
built early is ready once the host's imports and its own construction are done, whatever Ray does meanwhile.

Only where the first engine of every actor is known without Ray, so that no early engine is built for nothing:
- one model, whose engine spans one GPU, not reproducible (its actors keep their engines: cluster/launch.py);
- on GPUs: each GPU held by a known number of actors: whole GPUs or a fraction of one as the spec says
  (`num_gpus: 1`, `0.5`, `0.25`, ...), or, where it leaves that out, a model over SMALL_WEIGHTS_BYTES, which the rule
  gives one or two engines per GPU by whether its engines start uncompiled and this machine's GPUs' memory
  (cluster/plan/engines_per_gpu.py `large_model_engines`); as many actors as that makes on this machine's GPUs.
  Each actor's key is its GPU (Ray gives a local run's actors the GPUs this process sees); the engines of a GPU
  that actors share are told apart by slot, and each of its actors takes one (cluster/contracts/engine_host.py
  `claim_early`);
- without GPUs: one actor (the default), keyed CPU_KEY.
Its first engine is the model's, of the default (short) profile, with the actor's CPU threads and share of a GPU, as
actors/evaluator.py starts it. Once Ray is up and the fleet is sized, `EarlyPlan.holds` says whether the actors are
those planned; where not, the driver lets go of the early engines before any actor starts.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from cluster.contracts.engine_defaults import shared_starts_together, starts_uncompiled
from cluster.contracts.engine_host import CPU_KEY
from cluster.contracts.spec import SweepSpec
from cluster.plan.engines_per_gpu import SMALL_WEIGHTS_BYTES, large_model_engines, shares_per_gpu


@dataclass(frozen=True)
class EarlyEngine:
    key: str  # the GPUs of the actor that takes it (cluster/contracts/engine_host.py engine_key)
    env: dict[str, str]  # what its environment adds to the driver's: the key's GPUs
    start: dict  # the actor's `start_engine` keyword arguments, but the profile (the default one)
    threads: tuple[float, float, int]  # (num_cpus, num_gpus, the machine's GPUs): its engine's CPU threads
    slot: int = 0  # which of its GPU's engines (engines that share a GPU share its key)


@dataclass(frozen=True)
class EarlyPlan:
    model: str
    count: int  # actors
    num_gpus: float  # each actor's GPUs (0: a CPU actor)
    num_cpus: float
    engines: tuple[EarlyEngine, ...]

    def holds(self, size, lent) -> bool:
        """Whether the fleet sized once Ray was up (cluster/schedule/fleet_size.py FleetSize) is the one planned,
        its model not lent engines of a pool or an earlier sweep (`lent`: their names)."""
        shape = size.shapes.get(self.model)
        return (self.model not in lent and shape is not None and size.spec.actors.count == self.count
                and shape.num_gpus == self.num_gpus and shape.num_cpus == self.num_cpus)


def plan_early(spec: SweepSpec, model_path: str, gpus: list[str], weight_bytes: int | None,
               gpu_bytes: int | None = None) -> EarlyPlan | None:
    """The early engines of `spec` on a machine of `gpus` (local_gpus()) of `gpu_bytes` each (local_gpu_bytes(); None:
    unknown), its one model at `model_path` (resolved) with weights of `weight_bytes` (None: unknown); None where the
    actors' first engines are not known yet."""
    if spec.reproducible or len(spec.models) != 1 or spec.models[0].gpus_per_engine != 1:
        return None
    model, actors = spec.models[0], spec.actors
    if gpus:
        uncompiled = starts_uncompiled(model, weight_bytes, reproducible=False)  # a reproducible spec: none early
        per_gpu = _actors_per_gpu(actors.num_gpus, weight_bytes, gpu_bytes, uncompiled)
        if per_gpu is None or actors.count not in (None, per_gpu * len(gpus)) or \
                (per_gpu > 1 and not shared_starts_together()):  # serial starts: each after its neighbour's
            return None
        keys = [(gpu, {"CUDA_VISIBLE_DEVICES": gpu}, slot) for gpu in gpus for slot in range(per_gpu)]
        num_gpus = actors.num_gpus or 1.0 / per_gpu
    else:
        if actors.count not in (None, 1) or actors.accelerator_type is not None:
            return None
        keys, num_gpus = [(CPU_KEY, {}, 0)], 0.0
    start = {"model": model, "model_path": model_path, "num_threads": max(1, int(actors.num_cpus)),
             "gpu_fraction": num_gpus or 1.0, "sleep_mode": False, "reproducible": False}
    engines = tuple(EarlyEngine(key, env, start, (actors.num_cpus, num_gpus, len(gpus)), slot)
                    for key, env, slot in keys)
    return EarlyPlan(model.name, len(engines), num_gpus, actors.num_cpus, engines)


def local_gpu_bytes(gpus: list[str]) -> int | None:
    """The memory NVML reports for the first of `gpus` (local_gpus()), None where NVML cannot say."""
    if not gpus or not gpus[0].isdigit():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(int(gpus[0]))).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  (no NVML library or driver: unknown, and the rule decides once Ray is up)
        return None


def local_gpus() -> list[str]:
    """The GPUs a local Ray started from this process gives its actors, as their CUDA_VISIBLE_DEVICES names them:
    those of this process's CUDA_VISIBLE_DEVICES where it is set, else one per NVIDIA device NVML counts (or, without
    NVML, one per /dev/nvidiaN). CUDA itself is not started."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  (no NVML library or driver: the device files say)
        count = len([p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit()])
    return [str(i) for i in range(count)]


def _actors_per_gpu(num_gpus: float | None, weight_bytes: int | None, gpu_bytes: int | None,
                    uncompiled: bool) -> int | None:
    """How many actors each GPU will hold, where that is known before Ray is up: by the spec's share of a GPU
    (`num_gpus: 1`, 0.5, 0.25, ...), or, where the spec leaves it out, a model over SMALL_WEIGHTS_BYTES by the rule
    for this machine's GPUs and whether its engines start `uncompiled` (`large_model_engines`; one per GPU where
    their memory is not known, as the rule decides then). None where not known (a small model: Ray's view decides)."""
    if num_gpus is not None:  # as the fleet will be sized (engines_per_gpu.choose); over one GPU: not planned here
        return shares_per_gpu(num_gpus) if 0 < num_gpus <= 1 else None
    if (weight_bytes or 0) <= SMALL_WEIGHTS_BYTES:
        return None
    return 1 if gpu_bytes is None else large_model_engines(weight_bytes, gpu_bytes, uncompiled)
