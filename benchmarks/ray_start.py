"""Ray's own start on this host, without raysweep: `ray.init(address="local")` and then N one-CPU actors
answering a call (N: 16, or the host's CPUs where fewer), each variant in a process of its own, one JSON line each.

    python -m benchmarks.ray_start --rounds 3

Variants: `default` (Ray's defaults: dashboard on, one idle worker per CPU started ahead when the driver
connects), `nodash` (dashboard off: what `raysweep run` asks for), `noprestart` (no idle workers ahead),
`nodash_noprestart`, `cpus16` (Ray told of 16 CPUs). Each round runs them in that order."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ("default", "nodash", "noprestart", "nodash_noprestart", "cpus16")


def measure(variant: str) -> dict:
    """One variant, in this process: import, init, actors answering, shutdown (seconds)."""
    import os

    started = time.time()
    import ray

    imported = time.time()
    options: dict = {"address": "local", "log_to_driver": False}
    if "nodash" in variant:
        options["include_dashboard"] = False
    if "noprestart" in variant:
        options["_system_config"] = {"prestart_worker_first_driver": False}
    if "cpus16" in variant:
        options["num_cpus"] = 16
    ray.init(**options)
    up = time.time()

    @ray.remote(num_cpus=1)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    count = min(16, int(ray.cluster_resources().get("CPU", 1)))
    probes = [Probe.remote() for _ in range(count)]
    ray.get([p.pid.remote() for p in probes])
    answered = time.time()
    ray.shutdown()
    return {"variant": variant, "import_s": round(imported - started, 2), "init_s": round(up - imported, 2),
            "actors": count, "actors_ready_s": round(answered - up, 2),
            "shutdown_s": round(time.time() - answered, 2), "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_start", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this variant
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)), flush=True)
        return 0
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            subprocess.run([sys.executable, "-m", "benchmarks.ray_start", "--one", variant],
                           timeout=300, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
