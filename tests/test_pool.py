"""The engine pool (cluster/pool.py, jobs/pool.py) on a real `ray start --head` with Ray Serve and the CPU
engine: pool up / status / down, a sweep that sends a pooled model's shards to the pool and starts its own
actor for a model the pool serves with other engine arguments, and `pool down` refused while a sweep uses
the pool."""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT
from tests.test_cluster import TOKEN_AUTH, ray_head

ARITHMETIC = ROOT / "sweeps" / "data" / "arithmetic.jsonl"


def spec_file(path, models: list, actors: dict) -> str:
    spec = {"name": "pooled", "output": "out",
            "models": models,
            "tasks": [{"name": "arithmetic", "data": str(ARITHMETIC), "id_column": "id",
                       "prompt": "Question: {question}\nAnswer:", "target": "answer",
                       "sampling": {"max_tokens": 4, "temperature": 0.0}, "scorer": "numeric_match"}],
            "shards": {"max_samples": 50}, "actors": actors}
    path.write_text(json.dumps(spec))  # JSON is YAML
    return str(path)


def cli(*args: str, address: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=os.environ | TOKEN_AUTH | {"RAY_ADDRESS": address})


def start_sweep(spec: str, out, address: str) -> subprocess.Popen:
    """`raysweep run SPEC` on the cluster, in the background: its stdout and stderr as one text pipe."""
    return subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", spec, "--output", str(out), "--address", address],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | TOKEN_AUTH | {"RAY_ADDRESS": address})


@pytest.mark.slow
def test_a_sweep_uses_the_pool_for_the_models_it_serves_and_its_own_actors_for_the_rest(tmp_path):
    tiny = {"name": "tiny", "path": "builtin:tiny", "engine": {"max_num_seqs": 32}}
    pool_spec = spec_file(tmp_path / "pool.yaml", [tiny], {"count": 1, "num_cpus": 1})
    # the same model at the same path with another batch size: not the pool's engine
    other = {"name": "tiny8", "path": "builtin:tiny", "engine": {"max_num_seqs": 8}}
    sweep_spec = spec_file(tmp_path / "sweep.yaml", [tiny, other], {"count": 1, "num_cpus": 1})
    with ray_head("--num-cpus=4") as (address, _):
        up = cli("pool", "up", pool_spec, address=address)
        assert up.returncode == 0, up.stderr[-3000:]
        assert "pool: model tiny" in up.stdout

        status = cli("pool", "status", address=address)
        assert status.returncode == 0, status.stderr[-3000:]
        assert "tiny: healthy, replicas 1 running (max 1)" in status.stdout
        assert "0 shard(s) served" in status.stdout

        out = tmp_path / "results"
        run = cli("run", sweep_spec, "--output", str(out), "--address", address, address=address)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "model tiny8: the pool serves" in run.stdout and "engine.max_num_seqs 8 (pool: 32)" in run.stdout
        assert "[raysweep] pool serves model(s) tiny" in run.stdout

        results = pq.read_table(out / "results").to_pylist()
        for model in ("tiny", "tiny8"):  # every sample exactly once, for both models
            ids = [r["sample_id"] for r in results if r["model"] == model]
            assert len(ids) == len(set(ids)) == 150
        shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pylist()
        served = {(s["model"], s["served_by"].split(":")[0]) for s in shards}
        assert served == {("tiny", "pool"), ("tiny8", "actor")}
        engines = pq.read_table(out / "telemetry" / "actors.parquet").to_pylist()
        assert {e["model"] for e in engines} == {"tiny8"}  # no engine started for the pooled model

        status = cli("pool", "status", address=address)
        assert "3 shard(s) served" in status.stdout  # 150 samples in shards of 50

        # the pool's read-only HTTP API: the sweep that used it, its progress and its summary
        api = "http://127.0.0.1:8000/raysweep/sweeps"
        sweeps = json.loads(urllib.request.urlopen(api, timeout=10).read())
        assert [(s["name"], s["state"], s["samples_done"], s["samples_total"]) for s in sweeps] == \
            [("pooled", "done", 300, 300)]
        summary = json.loads(urllib.request.urlopen(f"{api}/pooled/summary", timeout=10).read())
        assert sorted((r["model"], r["n"]) for r in summary) == [("tiny", 150), ("tiny8", 150)]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{api}/nope", timeout=10)

        # a sweep holding a pool client: `pool down` is refused, `--force` removes the pool
        holder = subprocess.Popen(
            [sys.executable, "-c", "import ray, time\n"
             "from cluster.pool import CLIENT_NAMESPACE, PoolClient, sweeps_using_pool\n"
             f"ray.init(address={address!r})\n"
             "client = ray.remote(PoolClient).options(name='pool-client:holder', namespace=CLIENT_NAMESPACE, "
             "num_cpus=0).remote()\n"
             "while 'holder' not in sweeps_using_pool():\n    time.sleep(0.5)\n"
             "print('up', flush=True)\ntime.sleep(120)\n"],
            cwd=ROOT, env=os.environ | TOKEN_AUTH, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "up"  # its client is alive and seen
            down = cli("pool", "down", address=address)
            assert down.returncode == 2 and "sweeps use the pool now (holder)" in down.stderr, down.stderr
            assert cli("pool", "down", "--force", address=address).returncode == 0
        finally:
            holder.kill()
        gone = cli("pool", "status", address=address)
        assert gone.returncode == 2 and "no pool on this cluster" in gone.stderr


@pytest.mark.slow
def test_pool_down_force_while_a_sweep_uses_it_the_sweep_finishes_on_its_own_actors(tmp_path):
    tiny = {"name": "tiny", "path": "builtin:tiny", "engine": {"max_num_seqs": 32}}
    spec = spec_file(tmp_path / "pool.yaml", [tiny], {"count": 1, "num_cpus": 1})
    with ray_head("--num-cpus=4") as (address, _):
        assert cli("pool", "up", spec, address=address).returncode == 0
        out = tmp_path / "results"
        sweep = start_sweep(spec, out, address)
        lines = []
        for line in sweep.stdout:  # the pool down comes once the sweep sends it shards
            lines.append(line)
            if "pool serves model(s) tiny" in line:
                break
        down = cli("pool", "down", "--force", address=address)
        assert down.returncode == 0, down.stderr[-2000:]
        rest, _ = sweep.communicate(timeout=300)
        text = "".join(lines) + rest
        assert sweep.returncode == 0, text[-3000:]
        assert "the engine pool went away during the sweep: model(s) tiny went on with the sweep's own actors" in text
        ids = pq.read_table(out / "results", columns=["sample_id"])["sample_id"].to_pylist()
        assert len(ids) == len(set(ids)) == 150  # every sample exactly once


@pytest.mark.slow
def test_two_sweeps_at_once_share_the_pool_and_both_complete_exactly_once(tmp_path):
    tiny = {"name": "tiny", "path": "builtin:tiny", "engine": {"max_num_seqs": 32}}
    spec = spec_file(tmp_path / "pool.yaml", [tiny], {"count": 1, "num_cpus": 1})
    with ray_head("--num-cpus=4") as (address, _):
        assert cli("pool", "up", spec, address=address).returncode == 0
        sweeps = []
        for name in ("first", "second"):
            raw = json.loads(open(spec).read())
            raw["name"] = name
            (tmp_path / f"{name}.yaml").write_text(json.dumps(raw))
            sweeps.append(start_sweep(str(tmp_path / f"{name}.yaml"), tmp_path / name, address))
        for name, sweep in zip(("first", "second"), sweeps):
            text, _ = sweep.communicate(timeout=300)
            assert sweep.returncode == 0, text[-3000:]
            assert "pool serves model(s) tiny" in text
            ids = pq.read_table(tmp_path / name / "results", columns=["sample_id"])["sample_id"].to_pylist()
            assert len(ids) == len(set(ids)) == 150
            served = pq.read_table(tmp_path / name / "telemetry" / "shards.parquet")["served_by"].to_pylist()
            assert served and all(s.startswith("pool:") for s in served)
        status = cli("pool", "status", address=address)
        assert "6 shard(s) served" in status.stdout  # 3 shards of each sweep, on the one replica
