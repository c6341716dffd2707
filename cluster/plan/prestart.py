"""Engines started before Ray: which engines a local run's engine host starts while Ray and the actors start.

A local run's actors exist only once Ray is up (6-15 s on a GPU machine), and each engine then took 15-20 s to
build: on four H200s a 10,496-prompt sweep's first result came 43.6 s after its command began, 15 s of it Ray's
start (bench/records/4xh200-scale-out.md). Where the engines the run will start are known before Ray, the host
builds them during that time (cluster/contracts/engine_host.py PRESTART), and each actor takes the one on its
GPUs. They are known where:
- the run is local with an engine host (cluster/launch.py), not reproducible, and this machine has GPUs;
- one model runs, on engines of one GPU each, with no `actors.accelerator_type` (that is a cluster's);
- its files are here: a local folder, or a builtin model built already (a build or a download is the planner's);
- and `RAYSWEEP_PRESTART` is not 0 (`1` starts the CPU engine ahead too, where the machine has no GPU).
The engines per GPU and the actors' shape are what the run chooses once Ray is up (cluster/plan/engines_per_gpu.py,
cluster/plan/placement.py), from the GPUs Ray will find (its own detection). An engine the run does not ask for
in the end is closed by the actor that takes it, or stays unused until the run ends; an engine that failed to
build is built again by its actor: a wrong guess costs the time it would have cost without it.
"""

from __future__ import annotations

import os

from cluster.contracts.engine_host import Prestart
from cluster.contracts.spec import SweepSpec

SWITCH = "RAYSWEEP_PRESTART"  # auto (the default): on GPUs; 1: on CPUs too (the CPU engine); 0: never


def local_gpus() -> tuple[list[str], str | None]:
    """The GPU ids a local Ray gives its actors (CUDA_VISIBLE_DEVICES's, else 0..n-1) and their type as Ray
    names it (`accelerator_type:NAME`), by Ray's own detection (NVML: no CUDA context)."""
    from ray._private.accelerators import get_accelerator_manager_for_resource  # Ray is pinned (pyproject.toml)

    manager = get_accelerator_manager_for_resource("GPU")
    visible = manager.get_current_process_visible_accelerator_ids()
    ids = [str(i) for i in visible] if visible is not None else \
        [str(i) for i in range(manager.get_current_node_num_accelerators())]
    return ids, (manager.get_current_node_accelerator_type() if ids else None)


def prestarts(spec: SweepSpec, new_tokens: int | None, gpus: tuple[list[str], str | None] | None = None) -> list[Prestart]:
    """The engines to start ahead for `spec` (the run's, as opened), one per actor the run will start, with the
    GPUs each will have; none where that cannot be known (above). `gpus`: `local_gpus()` (a test's own)."""
    from cluster.plan.engines_per_gpu import choose, resolved
    from cluster.plan.placement import model_resources

    mode = os.environ.get(SWITCH, "auto")
    if mode == "0" or spec.reproducible or spec.actors.accelerator_type:
        return []
    models = [m for m in spec.models if any(t.replay is None for t in spec.tasks)]
    if len(models) != 1 or models[0].gpus_per_engine != 1:
        return []
    path = _files_here(spec.model_path(models[0]))
    ids, kind = gpus if gpus is not None else local_gpus()
    if path is None or not (ids or mode == "1"):
        return []
    resources = {"GPU": float(len(ids)), **({f"accelerator_type:{kind}": 1.0} if kind else {})} if ids else {}
    run = resolved(spec, choose(spec, resources, new_tokens=new_tokens))
    shape = model_resources(run.actors, run.models, resources)[models[0].name]
    per_gpu = max(1, round(1 / shape.num_gpus)) if 0 < shape.num_gpus <= 1 else 1
    # fewer actors than shares: the first GPUs' (where Ray puts them elsewhere, those actors start their own
    # engines: no GPU holds more engines than it has shares)
    slots = [gpu for gpu in ids for _ in range(per_gpu)] if ids else [""] * run.actors.count
    return [Prestart(gpu, shape.num_cpus, shape.num_gpus, len(ids), models[0], path)
            for gpu in slots[:run.actors.count]]


def _files_here(path: str) -> str | None:
    """The model's folder as the planner will name it (cluster/inputs/checks.py load_model_meta), where that
    needs no build or download; else None."""
    from cluster.inputs.builtin_model import built_path, is_builtin

    if is_builtin(path):
        return built_path(path)
    return path if os.path.isdir(path) else None
