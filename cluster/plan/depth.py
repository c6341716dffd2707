"""How many shards each actor (or pool replica) holds at once: enough to keep a streaming engine full."""

from __future__ import annotations

from cluster.contracts.engine_defaults import DEFAULT_MAX_SEQS
from cluster.contracts.spec import ModelSpec, SweepSpec

MIN_SHARDS_IN_FLIGHT, MAX_SHARDS_IN_FLIGHT = 2, 8


def shards_in_flight(spec: SweepSpec, model: ModelSpec) -> int:
    """Shards each actor holds at once: enough that four times the engine's batch (max_num_seqs) is
    queued, so a streaming engine stays full while each shard waits on its slowest request; at least two.
    Measured on an H100 with an 8B-shape model, 256-sample shards (bench/records/h100-shards-in-flight-large.md): 2 in
    flight ran at 93% of one 2,048-request batch, 3 at 96%, 4 at 99%; whole sweeps with 8 were no faster
    than with 4 (bench/records/h100-engine-ratios-large.md). `actors.shards_in_flight` overrides it."""
    if spec.actors.shards_in_flight is not None:
        return spec.actors.shards_in_flight
    batch = model.engine.get("max_num_seqs", DEFAULT_MAX_SEQS)
    wanted = -(-4 * batch // spec.shards.max_samples)
    return max(MIN_SHARDS_IN_FLIGHT, min(MAX_SHARDS_IN_FLIGHT, wanted))
