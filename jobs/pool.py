"""`raysweep pool up SPEC | status | down`: the engine pool (cluster/pool/serve_app.py) on a running Ray cluster.

The pool lives as long as the cluster does, so these commands join one (`--address`, else RAY_ADDRESS,
else `auto`: the cluster `ray start` runs on this machine); they never start a Ray of their own. Sweeps
use the pool when they run on the same cluster (`raysweep run SPEC --address auto`).
"""

from __future__ import annotations

import argparse
import os
import sys

from jobs.ray_output import add_verbose_argument, init_options, keep_quiet
from jobs.sweep import at_least


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="pool_command", required=True)
    up = sub.add_parser("up", help="start (or update) the pool from a spec's models and actors")
    up.add_argument("spec", help="a sweep spec: its models: and actors: are read")
    up.add_argument("--min-replicas", type=at_least(0), default=1, help="replicas per model kept while idle (default 1)")
    up.add_argument("--switch", action="store_true",
                    help="every replica holds every model, one awake, switching by sleep and wake (the default "
                         "where the cluster cannot hold a replica of each model at once)")
    up.add_argument("--http-port", type=at_least(1, 65535),
                    help="port of the pool's HTTP API (/raysweep/sweeps) (default: the port of the Ray Serve running "
                         "on the cluster, else 8000); refused where Serve serves an application (the pool too) on "
                         "another port")
    up.add_argument("--force", action="store_true", help="update the pool also while sweeps use it")
    sub.add_parser("status", help="models, replicas, state and each engine's start-up")
    down = sub.add_parser("down", help="remove the pool")
    down.add_argument("--force", action="store_true", help="also while sweeps use it (they go on with their own actors)")
    for p in (up, sub.choices["status"], down):
        p.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, else auto: the one `ray start` runs here)")
        add_verbose_argument(p)


def pool(args: argparse.Namespace) -> int:
    from cluster.pool import serve_app as pools

    if args.pool_command == "up":
        from cluster.inputs.checks import check_inputs
        from cluster.inputs.spec_file import load_spec

        spec = load_spec(args.spec)
        check_inputs(spec)  # the same checks, and lines, as a sweep's
        _connect(args.address, args.verbose)
        from jobs.interrupts import Interrupted, interrupted_in, interruptible

        asked: list[bool] = []  # Serve was asked to deploy: it goes on whether or not this command does
        try:
            with interruptible():
                description = pools.pool_up(spec, args.min_replicas, args.switch, args.http_port, args.force,
                                            deploying=lambda: asked.append(True))
        except (Interrupted, SystemError) as e:  # a SystemError raised from the Interrupted: it came in C code
            stop = e if isinstance(e, Interrupted) else interrupted_in(e)
            if stop is None:
                raise
            left = ("Ray Serve goes on deploying the pool on the cluster: `raysweep pool status` shows it, `raysweep "
                    "pool down` removes it" if asked else "nothing was asked of Ray Serve: the cluster's pool, if it "
                    "has one, is as it was")
            print(f"[raysweep] pool up stopped by {stop}: {left}", file=sys.stderr, flush=True)
            return 1
        for model in description["models"]:
            print(f"[raysweep] pool: model {model['name']} ({model['path']}) up to {model['max_replicas']} replica(s)")
        if description["switching"]:
            print(f"[raysweep] pool: models {', '.join(m['name'] for m in description['models'])} share each "
                  "replica's GPU share: one awake, the others asleep, switched by sleep and wake")
        return 0
    _connect(args.address, args.verbose)
    if args.pool_command == "status":
        for row in pools.pool_status():
            replicas = ", ".join(f"{n} {state.lower()}" for state, n in sorted(row["replicas"].items())) or "none"
            shared = " (switching: replicas shared with the pool's other models)" if row["switching"] else ""
            print(f"{row['model']}: {row['state'].lower()}, replicas {replicas} (max {row['max_replicas']}), "
                  f"{row['path']}{shared}")
            for r in row["engines"]:
                switches = f"; {r['switches']} switch(es), median {_s(r['switch_median_s'])}" if row["switching"] else ""
                print(f"  replica {r['replica']}: {r['shards']} shard(s) served, {r['queued']} waiting; "
                      f"awake {r['awake']}{switches}")
                for e in r["engines"]:
                    if e["model"] == row["model"]:
                        print(f"    {e['engine']} on {e['gpu_name'] or 'CPU'} at {e['node_ip']}: start-up "
                              f"{_s(e['startup_s'])} (imports {_s(e['imports_s'])}, engine {_s(e['engine_init_s'])}), "
                              f"ready {e['ready_at']}")
        return 0
    pools.pool_down(force=args.force)
    print("[raysweep] pool removed")
    return 0


def _connect(address: str | None, verbose: bool) -> None:
    import ray

    from cluster.pool.serve_app import PoolError

    from jobs.ray_start import check_ray_address

    named = "--address" if address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "address"
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    check_ray_address(address, named, ray_client=True)  # where nothing listens, ray.init retries for minutes
    try:
        # the pool's replicas are actors of the job that started Serve, maybe this one: their engines' start-up
        # output would come here, line by line, while the command waits for them (only with --verbose)
        ray.init(address=address, namespace="raysweep-pool", **(init_options(verbose) | {"log_to_driver": verbose}))
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise PoolError(f"no Ray cluster at {address} to hold the pool (start one: `ray start --head`): "
                        f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    keep_quiet(verbose)


def _s(value) -> str:
    return "—" if value is None else f"{value:.1f}s"
