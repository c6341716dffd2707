"""Where actors go: the Ray resources each actor asks for, whether any node can hold one, how many the
cluster can hold, and the capacity the driver asks the autoscaler for up front
(`ray.autoscaler.sdk.request_resources`), released when the sweep is done.

- GPUs: `actors.num_gpus` per actor where the cluster has GPUs now, or where the spec names an
  `accelerator_type` (an autoscaled GPU group may be at zero nodes); otherwise the actors run on CPUs.
  A model whose engine spans N GPUs (tensor_parallel_size x pipeline_parallel_size) has actors of N whole
  GPUs, on one node.
- `accelerator_type: L4` adds Ray's `accelerator_type:L4` resource, so actors land only on L4 nodes.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

from cluster.contracts.errors import RaysweepError
from cluster.contracts.spec import ActorSpec


class PlacementError(RaysweepError, ValueError):
    """No node of the cluster (present, or one the autoscaler may start) can hold one actor."""


ACCELERATOR_SHARE = 0.001  # how Ray itself asks for an accelerator type: a sliver of the node's marker resource


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float
    accelerator_type: str | None

    def options(self) -> dict:
        """Keyword arguments for `ActorClass.options(...)`."""
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        return options

    def bundle(self) -> dict:
        """One actor's share, as an autoscaler resource request."""
        bundle = {"CPU": self.num_cpus}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = ACCELERATOR_SHARE
        return bundle


def actor_resources(actors: ActorSpec, cluster_resources: dict, gpus_per_engine: int = 1) -> ActorResources:
    """What one actor asks Ray for. A model whose engine spans several GPUs (tensor x pipeline parallel)
    gets actors of that many whole GPUs: one actor's resources always come from one node, so its engine's
    GPUs are one node's (the placement a STRICT_PACK group would give), and vLLM runs its workers inside it."""
    wants_gpus = actors.accelerator_type is not None or cluster_resources.get("GPU", 0) > 0
    num_gpus = float(gpus_per_engine) if gpus_per_engine > 1 else actors.num_gpus
    return ActorResources(num_cpus=actors.num_cpus, num_gpus=num_gpus if wants_gpus else 0.0,
                          accelerator_type=actors.accelerator_type)


def model_resources(actors: ActorSpec, models, cluster_resources: dict) -> dict:
    """{model name: its actors' ActorResources}: one shape per GPU count an engine spans."""
    return {m.name: actor_resources(actors, cluster_resources, m.gpus_per_engine) for m in models}


def node_shapes(bundle: dict) -> tuple[list[dict], bool]:
    """The total resources of every alive node; where none of them can hold `bundle`, also one entry per
    node type the autoscaler may start (read only then: it costs a task on the head node). And whether
    an autoscaler config was found."""
    import ray

    alive = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    if any(fits(bundle, node) for node in alive):
        return alive, False
    head = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
    gcs_port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[-1]
    types = ray.get(ray.remote(read_node_types).options(**head).remote(gcs_port))
    return alive + types, bool(types)


def fits(bundle: dict, node: dict) -> int:
    """How many actors of `bundle` one node of these total resources holds."""
    counts = [math.floor(node.get(key, 0.0) / need + 1e-9) for key, need in bundle.items() if need > 0]
    return min(counts) if counts else 0


def capacity(resources: ActorResources, models: list[str]) -> int | None:
    """How many actors the cluster can hold at once: None (no bound) where an autoscaler can add nodes
    that hold one, else what the alive nodes hold. Raises PlacementError, naming `models` and the
    numbers, where no node (present, or of the autoscaler's types) can hold even one."""
    bundle = resources.bundle()
    shapes, autoscaled = node_shapes(bundle)
    if not any(fits(bundle, node) for node in shapes):
        largest = max(shapes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
        shown = {k: v for k, v in largest.items() if k in ("CPU", "GPU") or k.startswith("accelerator_type")}
        raise PlacementError(f"models {', '.join(models)}: an actor needs {_show(bundle)} (actors: in the spec), "
                             f"and no node of the cluster{' or of its autoscaler' if autoscaled else ''} "
                             f"has that; the largest has {_show(shown)}")
    return None if autoscaled else sum(fits(bundle, node) for node in shapes)


def _show(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def read_node_types(gcs_port: str) -> list[dict]:
    """Runs on the head node: the `available_node_types` of the config its autoscaler was started with
    (Ray 2.60 has no API that returns them): the `--autoscaling-config` of the monitor process of this
    cluster (its `--gcs-address` on `gcs_port`: another Ray's head on the same machine has its own), or the
    cluster launcher's ~/ray_bootstrap_config.yaml. [] where there is no autoscaler."""
    import glob

    import yaml

    paths = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.endswith("monitor.py") for a in args) and \
                any(a.startswith("--gcs-address=") and a.endswith(f":{gcs_port}") for a in args):
            paths += [a.split("=", 1)[1] for a in args if a.startswith("--autoscaling-config=")]
    paths.append(os.path.expanduser("~/ray_bootstrap_config.yaml"))
    for path in paths:
        try:
            with open(path) as f:
                types = (yaml.safe_load(f) or {}).get("available_node_types") or {}
        except (OSError, yaml.YAMLError):
            continue
        return [dict(t.get("resources") or {}) for t in types.values() if t.get("max_workers", 1) != 0]
    return []


@contextmanager
def requested_capacity(wanted: dict):
    """Ask the autoscaler for {ActorResources: count} actors' worth of resources (an N-GPU actor is one
    N-GPU bundle: a node that holds it whole); withdraw the request on exit. Without an autoscaler (a
    local Ray) the request is recorded and nothing happens."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[r.bundle() for r, count in wanted.items() for _ in range(count)])
    try:
        yield
    finally:
        request_resources(bundles=[])
