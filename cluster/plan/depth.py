"""How many shards each actor (or pool replica) holds at once: enough to keep a streaming engine full."""

from __future__ import annotations

from cluster.contracts.engine_defaults import DEFAULT_MAX_SEQS
from cluster.contracts.spec import ModelSpec, SweepSpec

MIN_SHARDS_IN_FLIGHT, MAX_SHARDS_IN_FLIGHT = 2, 8


def runs_on_cpu(model: ModelSpec, cluster_resources: dict, accelerator_type: str | None = None) -> bool:
    """The model's engine is the CPU engine: `backend: hf`, or `auto` on a cluster with no GPU that none is
    asked of (no `accelerator_type`)."""
    return model.backend == "hf" or (model.backend == "auto" and not cluster_resources.get("GPU")
                                     and accelerator_type is None)


def shards_in_flight(spec: SweepSpec, model: ModelSpec, cpu_engine: bool = False, rows: int | None = None,
                     actors: int | None = None) -> int:
    """Shards each actor holds at once: enough that four times the engine's batch (max_num_seqs) is
    queued, so a streaming engine stays full while each shard waits on its slowest request; at least two.
    The CPU engine (`cpu_engine`) runs one batch at a time: two, one running and the next ready. More would
    sit in its actor's queue where an actor whose model is done cannot take them: a fast and a slow model of
    one actor each, 48 rows in shards of 6, held six each and left the actors idle 47% of their time at the
    slow model's tail.
    Measured on an H100 with an 8B-shape model, 256-sample shards (bench/records/h100-shards-in-flight-large.md): 2 in
    flight ran at 93% of one 2,048-request batch, 3 at 96%, 4 at 99%; whole sweeps with 8 were no faster
    than with 4 (bench/records/h100-engine-ratios-large.md). `actors.shards_in_flight` overrides it.
    Many actors for few rows (`rows`: the sweep's rows, `actors`: the model's actors): no more than keeps about
    half of the model's shards waiting once every actor holds its share (rounded up, at least two), so that
    engines up a few seconds apart share the work and the tail can be cut (cluster/schedule/tail_split.py).
    Sixteen engines holding four shards each took all 43 shards of a 10,496-prompt sweep as they came up, and
    idled 29% of their GPU-seconds at its tail; holding two, 15% in a later call (bench/records/4xh200-scale-out.md).
    One actor shares with nobody: it holds the batch rule's count however few the rows."""
    if spec.actors.shards_in_flight is not None:
        return spec.actors.shards_in_flight
    if cpu_engine:
        return MIN_SHARDS_IN_FLIGHT
    batch = model.engine.get("max_num_seqs", DEFAULT_MAX_SEQS)
    wanted = -(-4 * batch // spec.shards.max_samples)
    if rows is not None and actors and actors > 1:
        wanted = min(wanted, -(-rows // (2 * actors * spec.shards.max_samples)))
    return max(MIN_SHARDS_IN_FLIGHT, min(MAX_SHARDS_IN_FLIGHT, wanted))
