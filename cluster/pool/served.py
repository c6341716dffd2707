"""What the engine pool serves, as a sweep reads it (cluster/pool/serve_app.py builds the pool): whether Serve
runs at all, the pool's description read from its ingress (`read_pool`, in the sweep's PoolClient actor,
cluster/pool/client.py), and which of a sweep's models it serves with the same arguments (`find_pool`)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.contracts.pool_protocol import APP, INGRESS, PROTOCOL
from cluster.contracts.spec import ModelSpec, SweepSpec


def pool_running() -> bool:
    """Whether the connected cluster runs Ray Serve at all (a cheap look, without importing Serve)."""
    import ray

    try:
        return any(a.get("name") == "SERVE_CONTROLLER_ACTOR" for a in ray.util.list_named_actors(all_namespaces=True))
    except Exception:
        return False


def pool_replicas() -> int:
    """How many engine replicas of the pool are actors on the connected cluster (Serve names each
    `SERVE_REPLICA::<app>#<deployment>#<id>`; the ingress, which holds no CPU, is not one); a cheap look, without
    importing Serve."""
    import ray

    prefix, ingress = f"SERVE_REPLICA::{APP}#", f"SERVE_REPLICA::{APP}#{INGRESS}#"
    try:
        names = [a.get("name", "") for a in ray.util.list_named_actors(all_namespaces=True)]
        return sum(name.startswith(prefix) and not name.startswith(ingress) for name in names)
    except Exception:  # noqa: BLE001  (not known: none said)
        return 0


@dataclass(frozen=True)
class PooledModel:
    """A model the pool serves: what a sweep's model must match to use it."""
    name: str
    path: str  # resolved local path
    backend: str
    engine: dict
    deployment: str
    max_replicas: int
    depth: int  # shards each replica's engine runs at once
    switching: bool = False  # shares its replicas with the pool's other models, switched by sleep and wake
    reproducible: bool = False  # the pool's engines run vLLM's batch-invariant mode

    def differences(self, model: ModelSpec, path: str, reproducible: bool = False) -> list[str]:
        """What differs from a sweep's model at the same path (empty: the sweep may use the pool)."""
        diffs = [f"backend {model.backend!r} (pool: {self.backend!r})"] if model.backend != self.backend else []
        if reproducible != self.reproducible:
            diffs.append(f"reproducible {str(reproducible).lower()} (pool: {str(self.reproducible).lower()})")
        for key in sorted(set(self.engine) | set(model.engine)):
            if self.engine.get(key) != model.engine.get(key):
                diffs.append(f"engine.{key} {model.engine.get(key)!r} (pool: {self.engine.get(key)!r})")
        return diffs


def read_pool(log=None) -> dict[str, PooledModel]:
    """The pool on the connected cluster, by model name; empty where there is none. A pool that is there
    but does not answer counts as none, and `log` (where given) says so in one line."""
    from ray import serve

    try:
        if APP not in serve.status().applications:
            return {}
    except Exception:  # no Serve on this cluster
        return {}
    try:
        description = serve.get_app_handle(APP).describe.remote().result(timeout_s=30)
    except Exception as e:  # the pool is going away, or its ingress is down
        if log is not None:
            log(f"[raysweep] the engine pool {APP} is on this cluster but did not answer "
                f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:200]}): the sweep runs on its own actors")
        return {}
    if description.get("protocol") != PROTOCOL:
        if log is not None:
            log(f"[raysweep] the engine pool {APP} was started by another raysweep version: the sweep runs on its "
                "own actors (`raysweep pool up SPEC` again starts it as this version)")
        return {}
    return {m["name"]: PooledModel(**m) for m in description["models"]}


def find_pool(spec: SweepSpec, paths: dict[str, str], served: dict[str, PooledModel],
              log=print) -> dict[str, PooledModel]:
    """The sweep's models the pool serves with the same path and engine arguments, by the sweep's model
    name. `paths`: each model's resolved path; `served`: what the pool serves (read_pool). A model at a
    pooled path with other arguments gets one line naming them, and the sweep's own actors."""
    pooled: dict[str, list[PooledModel]] = {}
    for m in served.values():
        pooled.setdefault(m.path, []).append(m)
    found = {}
    for model in spec.models:
        candidates = pooled.get(paths[model.name], [])
        same = [m for m in candidates if not m.differences(model, paths[model.name], spec.reproducible)]
        if same:
            found[model.name] = same[0]
        elif candidates:
            diffs = candidates[0].differences(model, paths[model.name], spec.reproducible)
            log(f"[raysweep] model {model.name}: the pool serves {paths[model.name]} with other engine "
                f"arguments ({'; '.join(diffs)}): it runs on the sweep's own actors")
    return found
