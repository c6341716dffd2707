"""The engine pool: started engines kept warm between sweeps, as one Ray Serve application.

`raysweep pool up SPEC` starts the application `raysweep-pool` on the connected cluster: per model of the
spec a deployment (`model-<name>`) whose replicas each hold one started engine on the GPU share the spec's
`actors` ask for (actors/pool_replica.PoolReplica), from `min_replicas` up to `actors.count` replicas,
scaled by Serve on the shards queued at it; and an ingress that says what the pool serves. A sweep spec is
a pool spec: its `models:` and `actors:` are read.

A sweep reads the pool through a `PoolClient` actor of its own (cluster/pool/client.py) and finds its models
there (cluster/pool/served.py); it sends the shards of every model the pool serves through that client (the
scheduler waits on plain Ray object refs); a model the pool does not serve, or serves with other engine
arguments (one line says which), gets the sweep's own actors.

Where the cluster cannot hold a replica of every model at once (`capacity`), or `pool up --switch` asks,
the models share one deployment (`models-shared`): each replica holds every model's engine, one awake and
the others asleep (vLLM sleep mode), and switches between them as shards ask (actors/shard_gate.py
groups them so switches are few). Each replica lets shards wait in it (QUEUED_PER_SLOT per engine slot)
so that they are ordered there, round robin between sweeps; Serve scales replicas on those queued shards.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from cluster.contracts.errors import RaysweepError
from cluster.contracts.pool_protocol import APP, PROTOCOL, QUEUED_PER_SLOT, ROUTE, SHARED_DEPLOYMENT, INGRESS
from cluster.inputs.builtin_model import resolve_model_path
from cluster.pool.client import sweeps_using_pool
from cluster.pool.served import read_pool
from cluster.pool.ingress import PoolIngress
from cluster.contracts.spec import SweepSpec


class PoolError(RaysweepError, ValueError):
    """The pool cannot be started, found or removed as asked; the message says why."""


def deployment_name(model: str) -> str:
    return f"model-{model}"


def describe(spec: SweepSpec, switching: bool = False) -> dict:
    """What a pool built from `spec` serves (kept by the ingress, read by sweeps and `pool status`);
    `switching`: every model in one deployment whose replicas switch between them."""
    from cluster.plan.depth import shards_in_flight

    depths = [shards_in_flight(spec, m) for m in spec.models]
    return {"spec": spec.name, "source": str(spec.source), "switching": switching, "protocol": PROTOCOL, "models": [
        {"name": m.name, "path": resolve_model_path(spec.model_path(m)), "backend": m.backend,
         "engine": dict(m.engine), "deployment": SHARED_DEPLOYMENT if switching else deployment_name(m.name),
         "max_replicas": spec.actors.count, "depth": min(depths) if switching else depth, "switching": switching,
         "reproducible": spec.reproducible}
        for m, depth in zip(spec.models, depths)]}


def build_app(spec: SweepSpec, min_replicas: int = 1, switch: bool = False):
    """The Serve application for `spec` (not started), and what it serves (describe). The models switch
    on shared replicas where `switch` asks or the cluster cannot hold a replica of each at once."""
    import ray
    from ray import serve

    from cluster.launch import pool_replica
    from cluster.plan.engines_per_gpu import choose, resolved
    from cluster.plan.placement import actor_resources, capacity

    PoolReplica = pool_replica()
    spec = resolved(spec, choose(spec, ray.cluster_resources()))  # actors left out: chosen
    if min_replicas < 0 or min_replicas > spec.actors.count:
        raise PoolError(f"--min-replicas {min_replicas}: must be from 0 to actors.count ({spec.actors.count})")
    spans = {m.gpus_per_engine for m in spec.models}
    resources = actor_resources(spec.actors, ray.cluster_resources(), max(spans))
    room = capacity(resources, [m.name for m in spec.models])  # refuses a spec no node can hold, naming the numbers
    switching = len(spec.models) > 1 and (switch or (room is not None and room < len(spec.models)))
    if switching and len(spans) > 1:
        raise PoolError(f"models {', '.join(m.name for m in spec.models)} would share pool replicas (switching), and "
                        f"their engines span different GPU counts ({', '.join(map(str, sorted(spans)))}): one replica "
                        "runs engines of one size; start a pool per size")
    description = describe(spec, switching)
    groups = [(description["models"], spec.models)] if switching else \
        [([info], [model]) for info, model in zip(description["models"], spec.models)]
    deployments = []
    for infos, models in groups:
        depth = infos[0]["depth"]
        resources = actor_resources(spec.actors, ray.cluster_resources(), models[0].gpus_per_engine)
        options = dict(name=infos[0]["deployment"], ray_actor_options=resources.options(),
                       max_ongoing_requests=depth * QUEUED_PER_SLOT,
                       autoscaling_config={"min_replicas": min_replicas, "initial_replicas": max(min_replicas, 1),
                                           "max_replicas": spec.actors.count,
                                           "target_ongoing_requests": depth,
                                           "upscale_delay_s": 2.0, "downscale_delay_s": 600.0},
                       health_check_period_s=10.0, graceful_shutdown_timeout_s=5.0)
        served = [dataclasses.replace(m, loglikelihood=True) for m in models]  # a pool serves any sweep's tasks
        deployments.append(serve.deployment(PoolReplica).options(**options).bind(
            served, [i["path"] for i in infos], resources.num_cpus, resources.num_gpus, depth, spec.reproducible))
    ingress = serve.deployment(PoolIngress).options(name=INGRESS, ray_actor_options={"num_cpus": 0})
    return ingress.bind(description, *deployments), description


DEFAULT_HTTP_PORT = 8000  # Serve's own default; another Serve on a shared host may hold it (`--http-port`)


def pool_up(spec: SweepSpec, min_replicas: int = 1, switch: bool = False, http_port: int | None = None,
            force: bool = False, deploying: Callable[[], None] = lambda: None) -> dict:
    """Start (or update) the pool on the connected cluster; returns once every deployment is running. The
    HTTP API listens on `http_port` (None: DEFAULT_HTTP_PORT where this starts Serve, else the port Serve has; see
    `_serve_started`). An update is refused while sweeps use the pool, unless `force`: it replaces the deployments
    their shards are on. `deploying()` is called as Serve is asked to deploy: from there, Serve deploys the pool
    whether or not this call returns."""
    from ray import serve

    if http_port is not None and not 1 <= http_port <= 65535:
        raise PoolError(f"--http-port {http_port}: must be from 1 to 65535")
    if APP in serve.status().applications:
        _refuse_while_used(force, "an update replaces the deployments their shards are on",
                           "shards of theirs on the pool may fail")
    app, description = build_app(spec, min_replicas, switch)
    _serve_started(http_port)
    deploying()
    serve.run(app, name=APP, route_prefix=ROUTE)
    return description


def _serve_started(http_port: int | None) -> None:
    """Ray Serve running, its HTTP API on `http_port` where one is asked for. A Serve already running keeps its
    port (`serve.start` changes nothing there), so: where it serves no application (the pool was taken down, Serve
    stays), it is started again on the port asked for; where it serves one (the pool, updated now, or another), a
    port other than its own is refused in one line, before anything changes."""
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    running = client.http_config if client is not None else None  # its host, port and the rest
    if http_port is not None and running is not None and running.port != http_port:
        served = sorted(serve.status().applications)
        if served:
            raise PoolError(f"--http-port {http_port}: Ray Serve runs on this cluster with its HTTP API on port "
                            f"{running.port}, serving {', '.join(served)}: its port changes only where it starts "
                            "anew; leave --http-port out, or take its applications down first")
        serve.shutdown()
        serve.start(http_options={"host": running.host, "port": http_port})  # the host it listened on kept
        return
    serve.start(http_options={"port": http_port or (running.port if running else DEFAULT_HTTP_PORT)})


def pool_status() -> list[dict]:
    """Per pooled model: its deployment's state and replicas, and each replica's start-up figures."""
    from ray import serve

    status = serve.status().applications.get(APP)
    if status is None:
        raise PoolError("no pool on this cluster (start one with `raysweep pool up SPEC`)")
    rows = []
    for name, model in read_pool().items():
        deployment = status.deployments.get(model.deployment)
        replicas = {str(getattr(k, "value", k)): n for k, n in (deployment.replica_states if deployment else {}).items()}
        rows.append({"model": name, "path": model.path, "switching": model.switching,
                     "state": str(getattr(deployment.status, "value", deployment.status)) if deployment else "?",
                     "replicas": replicas, "max_replicas": model.max_replicas,
                     "engines": _replica_infos(model.deployment, sum(replicas.values()))})
    return rows


def _replica_infos(deployment: str, count: int) -> list[dict]:
    """Each replica's `info` (Serve routes each call to some replica: asked a few times per replica)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP)
    found = {}
    for _ in range(3 * count):
        try:
            info = handle.info.remote().result(timeout_s=10)
        except Exception:
            break
        found[info["replica"]] = info
        if len(found) == count:
            break
    return list(found.values())


def pool_down(force: bool = False) -> None:
    """Remove the pool. Refused while sweeps use it, unless `force` (they go on with their own actors)."""
    from ray import serve

    if APP not in serve.status().applications:
        raise PoolError("no pool on this cluster")
    _refuse_while_used(force, "removing it", "they go on with their own actors")
    serve.delete(APP)


def _refuse_while_used(force: bool, doing: str, then: str) -> None:
    """PoolError where sweeps use the pool now (`doing` and `then` say what it would do to them), or whether they do
    cannot be told, unless `force`."""
    if force:
        return
    try:
        users = sweeps_using_pool()
    except Exception as e:  # unsure whether a sweep uses the pool: refuse
        raise PoolError(f"cannot tell whether sweeps use the pool ({type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0][:200]}); --force goes on anyway") from None
    if users:
        raise PoolError(f"sweeps use the pool now ({', '.join(users)}), and {doing}: wait for them, or --force: "
                        f"{then}")
