"""Bench part (w): sweeps on a warm engine pool against the plain vLLM script, whole processes.

    python -m jobs.bench_pool --model builtin:small --prompts 1312 --out DIR [--actors JSON]

In one run: `ray start --head` (its own process group), `raysweep pool up SPEC` (timed: what the pool's
start costs once), then the same sweep twice against the pool (`python -m jobs.sweep SPEC --address`, each
a whole process: imports, connecting, planning, the shards on the pool's warm engines, writing), then the
plain script (`python -m jobs.plain_vllm`, one untimed run first so its compile cache is warm, as the
pool's is; it runs first, as the pool holds the GPU once up), then `pool down` and the head stopped. Prints one `[bench] w ...` line per figure and the ratio
plain ÷ second sweep; the logs of every process go to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jobs.bench import prompts_of
from jobs.bench_e2e import count_lines, result_counts, run_process, summary_line, sweep_spec, vllm_args, write_prompts

# a bench's own cluster on one machine: no token to create and hand to every process
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench_pool", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--prompts", type=int, default=1312)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--actors", default='{"count": 2, "num_gpus": 0.5}', help="the pool's `actors` (JSON)")
    parser.add_argument("--out", default="bench/out-w")
    parser.add_argument("--cpu", action="store_true", help="a CPU check of the flow: the CPU engine, no plain script")
    args = parser.parse_args(argv)
    from cluster.builtin_model import resolve_model_path

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(args.model)
    data = write_prompts(out / "w_prompts.jsonl", prompts_of(args.prompts, 64, 1024, seed=11))
    spec = out / "w_spec.yaml"
    actors = json.loads(args.actors)
    raw = sweep_spec("w", out / "w_out", [("m", model)], [("t", data)], {}, args.max_tokens, actors)
    if args.cpu:
        raw["models"][0]["engine"]["backend"] = "hf"
    spec.write_text(json.dumps(raw))
    figures: dict[str, float] = {}

    def record(name: str, value: float, unit: str = "s") -> None:
        figures[name] = value
        print(f"[bench] w {name} = {value:.3f} {unit}", flush=True)

    if not args.cpu:  # first, while the GPU is free: the pool holds it once up
        script = [sys.executable, "-m", "jobs.plain_vllm", "--model", model, "--prompts", str(data), "--engine-args",
                  json.dumps(vllm_args(model, {})), "--max-tokens", str(args.max_tokens)]
        run_process(script, NO_AUTH, out / "w_plain_warm")
        wall, stdout = run_process(script, NO_AUTH, out / "w_plain")
        summary = summary_line(stdout) or {}
        if summary.get("outputs") != count_lines(data):
            raise RuntimeError(f"plain script: {summary.get('outputs')} outputs for {args.prompts} prompts")
        record("plain wall_s", wall)
        record("plain output_tokens", summary["output_tokens"], "tokens")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = NO_AUTH | {"RAY_ADDRESS": address}
    # `python -m ray.scripts.scripts` is the `ray` command, also where Ray is on PYTHONPATH without its scripts
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}", "--disable-usage-stats",
                             "--include-dashboard=false"], env=os.environ | NO_AUTH, start_new_session=True,
                            stdout=open(out / "w_head.stdout", "w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(address)
        wall, _ = run_process([sys.executable, "-m", "jobs.cli", "pool", "up", str(spec), "--min-replicas",
                               str(actors.get("count", 1))], env, out / "w_pool_up")
        record("pool up wall_s", wall)
        for n in (1, 2):
            output = out / f"w_sweep{n}"
            wall, _ = run_process([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(output),
                                   "--new-run", "--address", address], env, out / f"w_sweep{n}")
            rows, tokens = result_counts(output)
            if rows != args.prompts:
                raise RuntimeError(f"sweep {n}: {rows} outputs for {args.prompts} prompts")
            record(f"sweep{n} on the pool wall_s", wall)
            record(f"sweep{n} output_tokens", tokens, "tokens")
        _, status = run_process([sys.executable, "-m", "jobs.cli", "pool", "status"], env, out / "w_pool_status")
        print(status, flush=True)  # each replica's engine start-up and shards served
        if args.cpu:
            return 0
        record("RATIO plain/sweep2", figures["plain wall_s"] / figures["sweep2 on the pool wall_s"],
               "x (whole-process wall time; above 1: the sweep on the warm pool is faster)")
        run_process([sys.executable, "-m", "jobs.cli", "pool", "down", "--force"], env, out / "w_pool_down")
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
    (out / "w_figures.json").write_text(json.dumps(figures, indent=1))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(address: str, timeout_s: float = 120) -> None:
    host, port = address.split(":")
    deadline = time.time() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            time.sleep(3)  # the GCS answers before the raylet has registered
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"ray start --head did not come up at {address}")
            time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
