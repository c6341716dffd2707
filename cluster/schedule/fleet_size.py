"""How large the sweep's fleet is and how its actors are made, decided once as the sweep starts (the live
actors: cluster/schedule/fleet.py).

1. Engines per GPU: where the spec leaves the actors' count or GPU share open, they are chosen from the cluster
   and the models (cluster/plan/engines_per_gpu.py) and said; the spec is resolved with them.
2. Each model's actor shape (an engine of N GPUs needs actors of N GPUs), and how many actors of a shape the
   cluster holds at once (cluster/plan/placement.py: a shape no node can hold is refused here).
3. Each model's shards in flight per actor (cluster/plan/depth.py).
4. The spawn function the scheduler starts actors with: each named raysweep:NAME:N in the sweep's namespace,
   so another sweep of the same name running on the cluster is refused (SweepNameTaken).
5. What the autoscaler is asked for: the actors of the models that no pool or kept engine serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ray

from cluster.contracts.engine_defaults import shared_starts_together
from cluster.contracts.engine_host import EngineHostAddress
from cluster.contracts.errors import RaysweepError
from cluster.contracts.spec import SweepSpec
from cluster.plan.depth import MIN_SHARDS_IN_FLIGHT, runs_on_cpu, shards_in_flight
from cluster.plan.engines_per_gpu import EngineChoice, choose, resolved
from cluster.plan.placement import ActorResources, capacity, model_resources
from cluster.schedule.placement_wait import actor_name
from cluster.schedule.work import ModelWork


class SweepNameTaken(RaysweepError, RuntimeError):
    """Another sweep of the same name runs on this cluster now: its actors hold the names (and the dashboard's
    labels) this one would take."""

    def __init__(self, name: str):
        super().__init__(f"a sweep named {name!r} is running on this cluster now (its actors are named "
                         f"raysweep:{name}:N); wait for it, or give this sweep another `name:`")


@dataclass
class FleetSize:
    spec: SweepSpec  # resolved: the actors' count and GPU share set (step 1)
    engines: EngineChoice  # the actors' count and GPU share, and why
    shapes: dict[str, ActorResources]  # model name -> the shape of its actors
    holds: dict[ActorResources, int | None]  # shape -> how many the cluster holds at once (None: no bound)
    depths: dict[str, int]  # model name -> shards in flight per actor

    @property
    def start_one_by_one(self) -> bool:
        """Engines share a GPU and must start one at a time (cluster/contracts/engine_defaults.py)."""
        return any(0 < shape.num_gpus < 1 for shape in self.holds) and not shared_starts_together()

    @property
    def unit(self) -> str:
        """What an actor's time is counted in: GPU-seconds, or on CPUs actor-seconds."""
        return "GPU-seconds" if any(shape.num_gpus for shape in self.holds) else "actor-seconds"

    def work(self) -> list[ModelWork]:
        """Every model of the spec, as the scheduler sees it, before its shards are planned."""
        return [ModelWork(m.name, self.spec.actors.count, self.depths[m.name], shape=self.shapes[m.name])
                for m in self.spec.models]

    def requested(self, lent) -> dict[ActorResources, int]:
        """{shape: actors} to ask the autoscaler for (step 5): the models not `lent` engines already up
        (cluster/schedule/engine_sources.py), bounded per shape by what the cluster holds."""
        wanted: dict = {}
        for model in self.spec.models:
            if model.name not in lent:
                wanted[self.shapes[model.name]] = wanted.get(self.shapes[model.name], 0) + self.spec.actors.count
        return {shape: n if self.holds[shape] is None else min(n, self.holds[shape]) for shape, n in wanted.items()}

    def spawner(self, engine_host: EngineHostAddress | None = None) -> Callable[[int, float, Any], Any]:
        """Step 4: `spawn(number, requested_at, shape)`; `engine_host`: a local run's engine host
        (cluster/launch.py EngineHost), whose engine processes the actors on its machine use."""
        from cluster.launch import eval_actor_class

        spec = self.spec
        remote = ray.remote(eval_actor_class())
        namespace = f"raysweep-{spec.name}"
        if any(a.get("namespace") == namespace for a in ray.util.list_named_actors(all_namespaces=True)):
            raise SweepNameTaken(spec.name)
        depth = max(self.depths.values(), default=MIN_SHARDS_IN_FLIGHT)
        backends = tuple(sorted({m.backend for m in spec.models}))

        def spawn(n: int, requested_at: float, shape: ActorResources):
            # max_concurrency above the shards in flight: the next shard is admitted early, and
            # start_engine / close calls are never queued behind shards
            try:
                return remote.options(name=actor_name(spec.name, n), namespace=namespace,
                                      max_restarts=0, max_concurrency=depth + 2, **shape.options()).remote(
                    requested_at, shape.num_cpus, shape.num_gpus, backends, False, spec.reproducible, engine_host)
            except ray.exceptions.ActorAlreadyExistsError:  # another sweep of this name started meanwhile
                raise SweepNameTaken(spec.name) from None

        return spawn


def size_fleet(spec: SweepSpec, resources: dict, new_tokens: int | None, log: Callable[[str], None],
               rows: int | None = None) -> FleetSize:
    """Steps 1 to 3 for `spec` on a cluster of `resources` (ray.cluster_resources()); `new_tokens`: the most new
    tokens the sweep asks of each model (cluster/inputs/data.py generation_budget); `rows`: the rows each
    model runs (its actors then hold no more shards than leave half of them waiting, cluster/plan/depth.py)."""
    engines = choose(spec, resources, new_tokens=new_tokens)
    chosen = spec.actors.count is None or spec.actors.num_gpus is None
    if chosen and (resources.get("GPU") or spec.actors.accelerator_type):
        log(f"[raysweep] actors: {engines.reason}")
    spec = resolved(spec, engines)
    shapes = model_resources(spec.actors, spec.models, resources)
    holds = {shape: capacity(shape, [name for name, s in shapes.items() if s == shape])
             for shape in dict.fromkeys(shapes.values())}  # refuses a shape no node can hold
    depths = {m.name: shards_in_flight(spec, m, runs_on_cpu(m, resources, spec.actors.accelerator_type), rows,
                                       spec.actors.count) for m in spec.models}
    return FleetSize(spec, engines, shapes, holds, depths)
