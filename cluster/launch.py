"""The one place where the driver reaches into actors/: the classes it starts as Ray actors or Serve
replicas. Everything else in cluster/ knows actors only through the contracts (cluster/contracts/), and the
import rules (tests/test_architecture.py) hold it to that. Imported lazily, so the driver's planning never
loads the actors' engine code."""

from __future__ import annotations


def eval_actor_class():
    """EvalActor: one GPU share's engines, started by a sweep's scheduler (cluster/schedule/run.py)."""
    from actors.evaluator import EvalActor

    return EvalActor


def pool_replica():
    """PoolReplica: the engine pool's model deployments (cluster/pool/serve_app.py)."""
    from actors.pool_replica import PoolReplica

    return PoolReplica
