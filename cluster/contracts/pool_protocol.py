"""What a sweep's pool client and the pool's replicas agree on: names, the protocol version, and the errors
a replica raises or a client turns a failure into (cluster/pool/, actors/pool_replica.py)."""

from __future__ import annotations

from enum import Enum

APP = "raysweep-pool"  # the Serve application
ROUTE = "/raysweep"  # its HTTP route prefix
INGRESS = "ingress"
SHARED_DEPLOYMENT = "models-shared"  # the deployment whose replicas switch between every pooled model
QUEUED_PER_SLOT = 8  # shards a replica accepts per engine slot: the rest of a sweep's queue waits in its client
PROTOCOL = 2  # what PoolClient and PoolReplica.run_shard agree on; a pool of another raysweep is not used
CLIENT_NAMESPACE = "raysweep-pool-clients"  # where each sweep's PoolClient actor is named


class SweepState(str, Enum):
    """A sweep run's state in the pool's HTTP API: sent by its driver (cluster/schedule/engine_sources.py PoolStatus) as
    it runs and when it ends; `gone`: said by the ingress (cluster/pool/ingress.py) of one running but not heard
    from. Sent as its value, a plain string."""
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    GONE = "gone"


class PoolGone(RuntimeError):
    """The pool was removed while a sweep sent it shards: the sweep goes on with its own actors."""


class ReplicaDied(RuntimeError):
    """The pool replica running a shard died (Serve replaces it): the shard is retried, as on an actor's death."""


class ReplicaBroken(RuntimeError):
    """Raised by a replica whose engines are in an unknown state (a model switch failed): its health check
    fails too, so Serve replaces it; a sweep retries the shard as on a replica's death."""
