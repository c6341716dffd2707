"""Where actors go: the Ray resources each actor asks for, and the capacity the driver asks the
autoscaler for up front (`ray.autoscaler.sdk.request_resources`), released when the model is done.

- GPUs: `actors.num_gpus` per actor where the cluster has GPUs now, or where the spec names an
  `accelerator_type` (an autoscaled GPU group may be at zero nodes); otherwise the actors run on CPUs.
- `accelerator_type: L4` adds Ray's `accelerator_type:L4` resource, so actors land only on L4 nodes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from cluster.spec import ActorSpec

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


def actor_resources(actors: ActorSpec, cluster_resources: dict) -> ActorResources:
    wants_gpus = actors.accelerator_type is not None or cluster_resources.get("GPU", 0) > 0
    return ActorResources(num_cpus=actors.num_cpus, num_gpus=actors.num_gpus if wants_gpus else 0.0,
                          accelerator_type=actors.accelerator_type)


@contextmanager
def requested_capacity(resources: ActorResources, count: int):
    """Ask the autoscaler for `count` actors' worth of resources; withdraw the request on exit.
    Without an autoscaler (a local Ray) the request is recorded and nothing happens."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[resources.bundle()] * count)
    try:
        yield
    finally:
        request_resources(bundles=[])
