"""Bench part (w): sweeps on a warm engine pool against the plain vLLM script, whole processes.

    python -m benchmarks.pool --model builtin:small --prompts 1312 --out DIR [--actors JSON]
                              [--switch-model builtin:medium --switches 6]

In one run:
1. the plain script (`python -m benchmarks.plain_vllm`, one untimed run first so its compile cache is warm, as the
   pool's is; first, as the pool holds the GPU once up);
2. `ray start --head` (its own process group), `raysweep pool up SPEC` (timed: what the pool's start costs
   once), then the same sweep twice against the pool (`python -m jobs.sweep SPEC --address`, each a whole
   process: imports, connecting, planning, the shards on the pool's warm engines, writing); the ratio
   plain ÷ second sweep;
3. the sweep a third time, with one pool replica killed (`ray.kill`) once its first samples are done:
   the run must finish with every sample exactly once, the killed replica's shards run again, and Serve
   must bring the replica count back (the seconds it took are printed);
4. `pool down`, then a switching pool: the model and `--switch-model` on one replica of one whole GPU
   (`pool up --switch`), and sweeps of one model each, alternating, until `--switches` switches were made;
   the median switch (sleep + wake, telemetry/switches) ÷ the same engine's cold start (its start-up in
   the replica, `pool status`: engine construction and warm-up, the process's imports not counted).
Prints one `[bench] w ...` line per figure; the logs of every process go to DIR.
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

from benchmarks.common import (count_lines, prompts_of, result_counts, run_process, summary_line, sweep_spec,
                               vllm_args, write_prompts)
from benchmarks.whole_process import raysweep_figures

# a bench's own cluster on one machine: no token to create and hand to every process
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def _plain(model: str, data: Path, max_tokens: int, out: Path, record) -> None:
    """The plain script over the prompts, once to warm up and once timed."""
    script = [sys.executable, "-m", "benchmarks.plain_vllm", "--model", model, "--prompts", str(data),
              "--engine-args", json.dumps(vllm_args(model, {})), "--max-tokens", str(max_tokens)]
    run_process(script, NO_AUTH, out / "w_plain_warm")
    wall, stdout = run_process(script, NO_AUTH, out / "w_plain")
    summary = summary_line(stdout) or {}
    if summary.get("outputs") != count_lines(data):
        raise RuntimeError(f"plain script: {summary.get('outputs')} outputs for {count_lines(data)} prompts")
    record("plain wall_s", wall)
    record("plain output_tokens", summary["output_tokens"], "tokens")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pool", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--prompts", type=int, default=1312)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--actors", default='{"count": 2, "num_gpus": 0.5}', help="the pool's `actors` (JSON)")
    parser.add_argument("--out", default="bench/out-w")
    parser.add_argument("--cpu", action="store_true", help="a CPU check of the flow: the CPU engine, no plain script")
    parser.add_argument("--steps", default="warm,kill,switch",
                        help="which of: warm (steps 1-2), kill (3), switch (4); comma-separated")
    parser.add_argument("--switch-model", default="builtin:medium", help="the second model of the switching pool")
    parser.add_argument("--switches", type=int, default=6, help="switches to measure (at least)")
    parser.add_argument("--switch-prompts", type=int, default=256, help="prompts per sweep of the switching part")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    steps = set(args.steps.split(","))
    if not steps or steps - {"warm", "kill", "switch"}:
        parser.error(f"--steps {args.steps}: choose from warm, kill, switch")
    from cluster.inputs.builtin_model import resolve_model_path

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

    if not args.cpu and "warm" in steps:  # first, while the GPU is free: the pool holds it once up
        _plain(model, data, args.max_tokens, out, record)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = NO_AUTH | {"RAY_ADDRESS": address}
    # `python -m ray.scripts.scripts` is the `ray` command, also where Ray is on PYTHONPATH without its scripts
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}", "--disable-usage-stats",
                             "--include-dashboard=false"], env=os.environ | NO_AUTH, start_new_session=True,
                            stdout=open(out / "w_head.stdout", "w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(address)
        if steps & {"warm", "kill"}:
            _warm_pool(args, steps, spec, out, env, address, actors, figures, record)
        if "switch" in steps:
            _switching(args, model, data, out, env, address, record)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
    (out / "w_figures.json").write_text(json.dumps(figures, indent=1))
    return 0


def _warm_pool(args, steps: set, spec: Path, out: Path, env: dict, address: str, actors: dict, figures: dict,
               record) -> None:
    """Steps 2 and 3: the pool up, the sweep twice on it (warm), then once with a replica killed (kill)."""
    wall, _ = run_process([sys.executable, "-m", "jobs.cli", "pool", "up", str(spec), "--min-replicas",
                           str(actors.get("count", 1))], env, out / "w_pool_up")
    record("pool up wall_s", wall)
    for n in (1, 2) if "warm" in steps else ():
        output = out / f"w_sweep{n}"
        wall, _ = run_process([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(output),
                               "--new-run", "--address", address], env, out / f"w_sweep{n}")
        rows, tokens = result_counts(output)
        if rows != args.prompts:
            raise RuntimeError(f"sweep {n}: {rows} outputs for {args.prompts} prompts")
        record(f"sweep{n} on the pool wall_s", wall)
        record(f"sweep{n} output_tokens", tokens, "tokens")
        found = raysweep_figures(output)  # where the whole process's time went: Ray, planning, shards
        for name, (value, unit) in found.items():
            record(f"sweep{n} {name}", value, unit)
        if "shards_span_s" in found:  # the warm target: within 5 s of the time its shards generate
            record(f"sweep{n} beyond its shards s", wall - found["shards_span_s"][0],
                   "s (whole process less first shard start to last shard end)")
    _, status = run_process([sys.executable, "-m", "jobs.cli", "pool", "status"], env, out / "w_pool_status")
    print(status, flush=True)  # each replica's engine start-up and shards served
    if not args.cpu and "warm" in steps:
        record("RATIO plain/sweep2", figures["plain wall_s"] / figures["sweep2 on the pool wall_s"],
               "x (whole-process wall time; above 1: the sweep on the warm pool is faster)")
    if "kill" in steps:
        _killed_replica(spec, out, env, address, args.prompts, actors.get("count", 1), record)
    run_process([sys.executable, "-m", "jobs.cli", "pool", "down", "--force"], env, out / "w_pool_down")


def _killed_replica(spec: Path, out: Path, env: dict, address: str, prompts: int, replicas: int, record) -> None:
    """Step 3: the sweep again, one replica killed once its first samples are done."""
    import pyarrow.parquet as pq

    output = out / "w_sweep_kill"
    log = open(out / "w_sweep_kill.stdout", "w")
    sweep = subprocess.Popen([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(output), "--new-run",
                              "--address", address], env=os.environ | env | {"PYTHONUNBUFFERED": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in sweep.stdout:
        log.write(line)
        if f"/{prompts}" in line and "samples" in line and not line.strip().endswith(f" 0/{prompts}"):
            break
    killed_at = time.time()
    _, killed = run_process([sys.executable, "-c", KILL_REPLICA], env, out / "w_kill")
    for line in sweep.stdout:
        log.write(line)
    if sweep.wait() != 0:
        raise RuntimeError(f"the sweep with a replica killed exited {sweep.returncode}: see {log.name}")
    ids = pq.read_table(output / "results", columns=["sample_id"])["sample_id"].to_pylist()
    attempts = pq.read_table(output / "telemetry" / "shards.parquet", columns=["attempt"])["attempt"].to_pylist()
    print(f"[bench] w kill: replica {killed.strip()} killed; {len(ids)} rows, {len(set(ids))} distinct sample ids "
          f"for {prompts} prompts; {sum(a > 1 for a in attempts)} shard(s) run again", flush=True)
    if sorted(set(ids)) != sorted(ids) or len(ids) != prompts:
        raise RuntimeError("the sweep with a replica killed did not commit every sample exactly once")
    if not any(a > 1 for a in attempts):
        raise RuntimeError("no shard ran again: the replica was killed with none of this sweep's shards on it")
    while time.time() - killed_at < 600:
        _, status = run_process([sys.executable, "-m", "jobs.cli", "pool", "status"], env, out / "w_kill_status")
        if f"replicas {replicas} running" in status:
            record("kill: replicas back to full after", time.time() - killed_at)
            return
        time.sleep(2)
    raise RuntimeError("Serve did not replace the killed replica within 600 s")


KILL_REPLICA = """import ray
ray.init()
names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::raysweep-pool#model-"))
ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
print(names[0])
"""


def _switching(args, model: str, data: Path, out: Path, env: dict, address: str, record) -> None:
    """Step 4: two models on one replica, sweeps alternating between them."""
    import statistics

    import pyarrow.parquet as pq
    from cluster.inputs.builtin_model import resolve_model_path

    other = resolve_model_path(args.switch_model)
    small = write_prompts(out / "w_switch_prompts.jsonl", prompts_of(args.switch_prompts, 64, 1024, seed=12))
    actors = {"count": 1, "num_gpus": 0 if args.cpu else 1}
    specs = {}
    for name, models in (("pool", [("a", model), ("b", other)]), ("a", [("a", model)]), ("b", [("b", other)])):
        raw = sweep_spec(f"w-switch-{name}", out / f"w_switch_{name}", models, [("t", small)], {}, 64, actors)
        for m in raw["models"]:
            m["engine"]["backend"] = "hf" if args.cpu else "vllm"
        specs[name] = out / f"w_switch_{name}.yaml"
        specs[name].write_text(json.dumps(raw))
    wall, _ = run_process([sys.executable, "-m", "jobs.cli", "pool", "up", str(specs["pool"]), "--switch"], env,
                          out / "w_switch_up")
    record("switching pool up wall_s", wall)
    switches, n = [], 0
    while len(switches) < args.switches and n < 3 * args.switches:
        name = "ab"[n % 2]  # b is awake after the pool's start: a first
        output = out / f"w_switch_{name}{n}"
        run_process([sys.executable, "-m", "jobs.sweep", str(specs[name]), "--output", str(output), "--new-run",
                     "--address", address], env, out / f"w_switch_sweep{n}")
        path = output / "telemetry" / "switches.parquet"
        switches += pq.read_table(path).to_pylist() if path.exists() else []
        n += 1
    _, status = run_process([sys.executable, "-m", "jobs.cli", "pool", "status"], env, out / "w_switch_status")
    print(status, flush=True)
    (out / "w_switches.json").write_text(json.dumps(switches, default=str, indent=1))
    for row in switches:
        print(f"[bench] w switch {row['slept_model']} -> {row['model']}: sleep {row['sleep_s']:.3f} s, "
              f"wake {row['wake_s']:.3f} s", flush=True)
    cold = _startups(status)
    median = statistics.median(r["switch_s"] for r in switches)
    record("switch median_s", median)
    for name, startup in cold.items():
        record(f"cold start {name} s", startup)
    record("RATIO switch/cold start", median / min(cold.values()),
           "x (median switch over the faster engine's cold start; target at most 0.1)")
    run_process([sys.executable, "-m", "jobs.cli", "pool", "down", "--force"], env, out / "w_switch_down")


def _startups(status: str) -> dict[str, float]:
    """Each model's engine start-up in the switching replica, from `pool status`."""
    import re

    found, model = {}, None
    for line in status.splitlines():
        if not line.startswith(" "):
            model = line.split(":")[0]
        elif (m := re.search(r"start-up ([\d.]+)s", line)) and model:
            found[model] = float(m.group(1))
    return found


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
