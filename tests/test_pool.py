"""The engine pool (cluster/pool/serve_app.py, jobs/pool.py) on a real `ray start --head` with Ray Serve and the CPU
engine: pool up / status / down, a sweep that sends a pooled model's shards to the pool and starts its own
actor for a model the pool serves with other engine arguments, `pool down` refused while a sweep uses
the pool, two sweeps taking turns on one replica while the HTTP API follows them, a replica killed
mid-sweep, and two models switching on one replica by sleep and wake."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pyarrow.parquet as pq
import pytest

from tests.conftest import ROOT
from tests.test_cluster import TOKEN_AUTH, free_port, ray_head
from tests.test_ray_output import RAY_LINE

ARITHMETIC = ROOT / "sweeps" / "data" / "arithmetic.jsonl"


def spec_file(path, models: list, actors: dict, max_samples: int = 50, max_tokens: int = 4, name: str = "pooled") -> str:
    spec = {"name": name, "output": "out",
            "models": models,
            "tasks": [{"name": "arithmetic", "data": str(ARITHMETIC), "id_column": "id",
                       "prompt": "Question: {question}\nAnswer:", "target": "answer",
                       "sampling": {"max_tokens": max_tokens, "temperature": 0.0}, "scorer": "numeric_match"}],
            "shards": {"max_samples": max_samples}, "actors": actors}
    path.write_text(json.dumps(spec))  # JSON is YAML
    return str(path)


def cli(*args: str, address: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    if args[:2] == ("pool", "up") and "--http-port" not in args:  # never Serve's 8000: another Serve may hold it
        args = (*args, "--http-port", str(free_port()))
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=os.environ | TOKEN_AUTH | {"RAY_ADDRESS": address} | (env or {}))


def start_sweep(spec: str, out, address: str) -> subprocess.Popen:
    """`raysweep run SPEC` on the cluster, in the background: its stdout and stderr as one text pipe."""
    return subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", spec, "--output", str(out), "--address", address],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | TOKEN_AUTH | {"RAY_ADDRESS": address})


@pytest.fixture(scope="module")
def module_head():
    """One `ray start --head` of 4 CPUs (a replica and a sweep's own actors) for this file's pool tests, and the HTTP
    port of the Serve they start on it (Serve keeps the port of its first start): a head of its own, and Serve on it,
    took 10-30 s of each test on a loaded 2-core machine."""
    with ray_head("--num-cpus=4") as (address, _):
        yield address, free_port()


@pytest.fixture
def head(module_head):
    """The module's head, as `with head as (address, http_port):`; a pool the test left up (a failure mid-test, or
    one it had no need to take down) is taken down after it, so each test starts on a cluster without one."""
    @contextmanager
    def pool_taken_down_after():
        address, http = module_head
        try:
            yield address, http
        finally:
            try:  # the pool's HTTP API answers only while a pool is up
                urllib.request.urlopen(f"http://127.0.0.1:{http}/raysweep/sweeps", timeout=10)
            except OSError:
                return
            cli("pool", "down", "--force", address=address)
    return pool_taken_down_after()


@pytest.mark.slow
def test_a_sweep_uses_the_pool_for_the_models_it_serves_and_its_own_actors_for_the_rest(tmp_path, head):
    tiny = {"name": "tiny", "path": "builtin:tiny", "engine": {"max_num_seqs": 32}}
    pool_spec = spec_file(tmp_path / "pool.yaml", [tiny], {"count": 1, "num_cpus": 1})
    # the same model at the same path with another batch size: not the pool's engine
    other = {"name": "tiny8", "path": "builtin:tiny", "engine": {"max_num_seqs": 8}}
    sweep_spec = spec_file(tmp_path / "sweep.yaml", [tiny, other], {"count": 1, "num_cpus": 1})
    with head as (address, http):
        up = cli("pool", "up", pool_spec, "--http-port", str(http), address=address)
        assert up.returncode == 0, up.stderr[-3000:]
        assert "pool: model tiny" in up.stdout

        status = cli("pool", "status", address=address)
        assert status.returncode == 0, status.stderr[-3000:]
        assert "tiny: healthy, replicas 1 running (max 1)" in status.stdout
        assert "0 shard(s) served" in status.stdout
        # Serve keeps its port while it serves: another one asked for is refused, before anything changes
        other = free_port()
        moved = cli("pool", "up", pool_spec, "--http-port", str(other), address=address)
        assert moved.returncode == 2 and moved.stderr.strip().splitlines()[-1] == (
            f"raysweep: error: --http-port {other}: Ray Serve runs on this cluster with its HTTP API on port {http}, "
            "serving raysweep-pool: its port changes only where it starts anew; leave --http-port out, or take its "
            "applications down first"), moved.stderr[-3000:]

        out = tmp_path / "results"
        run = cli("run", sweep_spec, "--output", str(out), "--address", address, address=address,
                  env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "model tiny8: the pool serves" in run.stdout and "engine.max_num_seqs 8 (pool: 32)" in run.stdout
        assert "[raysweep] pool serves model(s) tiny" in run.stdout
        # the driver reads the pool through its client actor: Serve is imported there, not in the driver
        imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
        assert "ray" in imported and "ray.serve" not in imported
        run.stderr = "\n".join(line for line in run.stderr.splitlines() if not line.startswith("import time:"))
        # no Serve INFO lines (its router's, the replicas' CALL lines) and no Ray lines without --verbose
        for said in (up.stdout + up.stderr, run.stdout + run.stderr):
            assert not RAY_LINE.search(said), said[-3000:]

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
        api = f"http://127.0.0.1:{http}/raysweep/sweeps"
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
             "from cluster.contracts.pool_protocol import CLIENT_NAMESPACE\nfrom cluster.pool.client import PoolClient, sweeps_using_pool\n"
             f"ray.init(address={address!r})\n"
             "client = ray.remote(PoolClient).options(name='pool-client:holder', namespace=CLIENT_NAMESPACE, "
             "num_cpus=0).remote('holder')\n"
             "while 'holder' not in sweeps_using_pool():\n    time.sleep(0.5)\n"
             "print('up', flush=True)\ntime.sleep(120)\n"],
            cwd=ROOT, env=os.environ | TOKEN_AUTH, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "up"  # its client is alive and seen
            with ray_head("--num-cpus=1"):  # another Ray on the host: the check asked the wrong one, found nobody
                down = cli("pool", "down", address=address)
            assert down.returncode == 2 and "sweeps use the pool now (holder)" in down.stderr, down.stderr
            # an update would replace the deployments under it: refused too (it failed a running sweep's shards)
            again = cli("pool", "up", sweep_spec, address=address)
            assert again.returncode == 2 and "sweeps use the pool now (holder), and an update replaces the " \
                "deployments their shards are on: wait for them, or --force" in again.stderr, again.stderr
            assert cli("pool", "down", "--force", address=address).returncode == 0
        finally:
            holder.kill()
        gone = cli("pool", "status", address=address)
        assert gone.returncode == 2 and "no pool on this cluster" in gone.stderr
        # Serve, left running by `down` and serving nothing, starts again on the port asked for (a replica of the
        # fake engine: what it serves is not the point, and the CPU engine's replica imports torch)
        fake = spec_file(tmp_path / "fake.yaml", [{"name": "tiny", "path": "builtin:tiny", "engine": {"backend": "fake"}}],
                         {"count": 1, "num_cpus": 1})
        assert cli("pool", "up", fake, "--http-port", str(other), address=address).returncode == 0
        assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{other}/raysweep/sweeps", timeout=10).read()) == []
        assert cli("pool", "down", address=address).returncode == 0


@pytest.mark.slow
def test_pool_down_force_while_a_sweep_uses_it_the_sweep_finishes_on_its_own_actors(tmp_path, head):
    # once the pool has run some of the sweep's shards (0.4 s each: 12 s for all 30, so the test sees the first done
    # with most still to run), its replica holds the rest (the fake engine's hold_file) until the pool is down: the
    # pool goes down mid-sweep however long `pool down` takes; the sweep's own actors then run the rest
    hold = tmp_path / "hold"
    tiny = {"name": "tiny", "path": "builtin:tiny",
            "engine": {"backend": "fake", "delay_s": 0.4, "hold_file": str(hold)}}
    spec = spec_file(tmp_path / "pool.yaml", [tiny], {"count": 1, "num_cpus": 1, "shards_in_flight": 1},
                     max_samples=5)
    with head as (address, http):
        assert cli("pool", "up", spec, "--http-port", str(http), address=address).returncode == 0
        out = tmp_path / "results"
        sweep = start_sweep(spec, out, address)
        lines = []
        for line in sweep.stdout:  # the pool holds the rest once it has run some of the sweep's shards
            lines.append(line)
            if re.search(r"\] [1-9]\d*/150 samples", line):
                break
        hold.touch()
        down = cli("pool", "down", "--force", address=address)
        assert down.returncode == 0, down.stderr[-2000:]
        hold.unlink()
        rest, _ = sweep.communicate(timeout=300)
        text = "".join(lines) + rest
        assert sweep.returncode == 0, text[-3000:]
        assert "the engine pool went away during the sweep: model(s) tiny went on with the sweep's own actors" in text
        ids = pq.read_table(out / "results", columns=["sample_id"])["sample_id"].to_pylist()
        assert len(ids) == len(set(ids)) == 150  # every sample exactly once


@pytest.mark.slow
def test_two_sweeps_at_once_take_turns_on_the_pool_and_the_http_api_follows_them(tmp_path, head):
    # the replica's engine holds each batch while `hold` exists (the fake engine's hold_file): both sweeps come up
    # and queue their shards there before it runs any, however far apart their drivers start on a loaded machine.
    # Once running, a shard takes 0.5 s: each sweep keeps two shards at the pool, and the one sent back in place of
    # a finished one has 1.5 s to get there before that sweep's turn finds nothing of it waiting
    hold = tmp_path / "hold"
    hold.touch()
    tiny = {"name": "tiny", "path": "builtin:tiny",
            "engine": {"backend": "fake", "delay_s": 0.5, "hold_file": str(hold)}}
    actors = {"count": 1, "num_cpus": 1, "shards_in_flight": 1}  # one replica, one shard at a time: turns show
    pool = spec_file(tmp_path / "pool.yaml", [tiny], actors)
    with head as (address, http):
        assert cli("pool", "up", pool, "--http-port", str(http), address=address).returncode == 0
        sweeps = {name: start_sweep(spec_file(tmp_path / f"{name}.yaml", [tiny], actors, max_samples=10, name=name),
                                    tmp_path / name, address)
                  for name in ("first", "second")}
        api = f"http://127.0.0.1:{http}/raysweep/sweeps"

        def runs() -> dict:  # the HTTP API's sweeps by name ({} where it did not answer)
            try:
                return {s["name"]: s for s in json.loads(urllib.request.urlopen(api, timeout=5).read())}
            except OSError:
                return {}

        deadline = time.monotonic() + 300  # both sweeps planned, each with shards held at the replica
        while not all(runs().get(name, {}).get("samples_total") == 150 for name in sweeps):
            assert time.monotonic() < deadline and all(p.poll() is None for p in sweeps.values()), runs()
            time.sleep(0.2)
        hold.unlink()
        seen_running = set()  # the HTTP API while the sweeps run: their progress, part done
        live = {}  # the live report of a sweep part done: it reloads itself
        while any(p.poll() is None for p in sweeps.values()):
            for s in runs().values():
                if s["state"] == "running" and 0 < s["samples_done"] < s["samples_total"] == 150:
                    seen_running.add(s["name"])
                    if not live:  # read while the replica holds: the sweep still runs
                        hold.touch()
                        live = {"name": s["name"], "page": urllib.request.urlopen(
                            f"{api}/{s['run_id']}/report", timeout=30).read().decode()}
                        hold.unlink()
            time.sleep(0.2)
        order = []
        for name, sweep in sweeps.items():
            text = sweep.stdout.read()
            assert sweep.returncode == 0, text[-3000:]
            assert "pool serves model(s) tiny" in text
            ids = pq.read_table(tmp_path / name / "results", columns=["sample_id"])["sample_id"].to_pylist()
            assert len(ids) == len(set(ids)) == 150
            shards = pq.read_table(tmp_path / name / "telemetry" / "shards.parquet").to_pylist()
            assert shards and all(s["served_by"].startswith("pool:") for s in shards)
            order += [(s["pool_sequence"], name) for s in shards]
        assert seen_running == {"first", "second"}
        final = {s["name"]: s for s in json.loads(urllib.request.urlopen(api, timeout=10).read())}
        assert {n: (s["state"], s["samples_done"]) for n, s in final.items()} == {"first": ("done", 150),
                                                                                 "second": ("done", 150)}
        assert f"<h1>raysweep report: {live['name']}</h1>" in live["page"] and 'http-equiv="refresh"' in live["page"]
        page = urllib.request.urlopen(f"http://127.0.0.1:{http}/raysweep/", timeout=10).read().decode()
        assert f'href="/raysweep/sweeps/{final["first"]["run_id"]}/report"' in page and "second" in page
        report = urllib.request.urlopen(f"{api}/second/report", timeout=30).read().decode()
        assert '<table id="comparison">' in report and 'http-equiv="refresh"' not in report  # done: no reload
        # turns: while both sweeps had shards at the replica, it ran one of each in turn (first come first served
        # runs each sweep's queued shards back to back). Both had shards there from the first: of their 15
        # shards each, at least 10 ran in turns
        names = [name for _, name in sorted(order)]
        overlap = names[max(names.index("first"), names.index("second")):
                        min(len(names) - names[::-1].index(n) for n in ("first", "second"))]
        assert len(overlap) >= 10 and all(a != b for a, b in zip(overlap, overlap[1:])), names
        status = cli("pool", "status", address=address)
        assert "30 shard(s) served" in status.stdout  # 15 shards of each sweep, on the one replica


@pytest.mark.slow
def test_a_replica_killed_mid_sweep_is_replaced_and_its_shards_run_again_exactly_once(tmp_path, head):
    # the replicas hold the shards they are sent (the fake engine's hold_file) until one of them is killed: the kill
    # lands mid-sweep, on a replica with shards in it where Serve's router sent it some (with tiny's CPU engine the
    # sweep's 30 shards could all be done before the kill's own process had started)
    hold = tmp_path / "hold"
    hold.touch()
    tiny = {"name": "tiny", "path": "builtin:tiny", "engine": {"backend": "fake", "hold_file": str(hold)}}
    actors = {"count": 2, "num_cpus": 1, "shards_in_flight": 1}
    spec = spec_file(tmp_path / "pool.yaml", [tiny], actors, max_samples=5)
    with head as (address, http):
        assert cli("pool", "up", spec, "--min-replicas", "2", "--http-port", str(http), address=address).returncode == 0
        out = tmp_path / "results"
        sweep = start_sweep(spec, out, address)
        lines = []
        for line in sweep.stdout:  # the kill comes once the sweep's shards are at the pool
            lines.append(line)
            if re.search(r"\] 0/150 samples .* [1-9]\d* shard\(s\) in flight", line):
                break
        kill = subprocess.run(
            [sys.executable, "-c", "import ray\n"
             f"ray.init(address={address!r})\n"
             "names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)\n"
             "         if a['name'].startswith('SERVE_REPLICA::raysweep-pool#model-tiny')]\n"
             "ray.kill(ray.get_actor(names[0], namespace='serve'), no_restart=True)\nprint(names[0])\n"],
            cwd=ROOT, env=os.environ | TOKEN_AUTH, capture_output=True, text=True, timeout=60)
        assert kill.returncode == 0, kill.stderr[-2000:]
        hold.unlink()
        rest, _ = sweep.communicate(timeout=300)
        text = "".join(lines) + rest
        assert sweep.returncode == 0, text[-3000:]
        ids = pq.read_table(out / "results", columns=["sample_id"])["sample_id"].to_pylist()
        assert len(ids) == len(set(ids)) == 150  # every sample exactly once
        shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pylist()
        # each shard that was on the killed replica ran again (Serve's router may have put none there:
        # the GPU bench's kill had one, bench/records/h100-engine-pool.md)
        died = {line.split()[2] for line in text.splitlines() if "failed: ReplicaDied" in line}
        assert died <= {s["shard_id"] for s in shards if s["attempt"] >= 2}, died
        # both replicas ran at once (a pool keeps every replica busy): the two that finished the most
        # shards have shard windows that overlap. Only where the kill took one replica before it finished a shard
        # (Serve's router had put the first shards in flight on the other) and its replacement came up after the
        # last one (seen in CI, stop 37, and with two xdist workers) did one replica finish them all: the survivor
        windows: dict = {}
        for s in shards:
            if s["started_at"] and s["finished_at"]:
                windows.setdefault(s["served_by"], []).append((s["started_at"], s["finished_at"]))
        served = sorted(windows, key=lambda k: -len(windows[k]))
        if len(served) >= 2:
            a, b = served[:2]
            assert any(x0 < y1 and y0 < x1 for x0, x1 in windows[a] for y0, y1 in windows[b]), windows
        else:
            killed = "pool:" + kill.stdout.split()[-1].rsplit("#", 1)[-1]
            assert served and killed not in served, f"{killed} was killed, and it alone finished shards: {windows}"
        for _ in range(60):  # Serve replaces the replica
            status = cli("pool", "status", address=address)
            if "replicas 2 running" in status.stdout:
                break
            time.sleep(2)
        assert "replicas 2 running" in status.stdout, status.stdout


@pytest.mark.slow
def test_two_models_on_one_replica_switch_by_sleep_and_wake_and_run_grouped(tmp_path, head):
    from cluster.inputs.builtin_model import resolve_model_path

    copy = tmp_path / "tiny-copy"  # a second model: the built tiny one at another path
    shutil.copytree(resolve_model_path("builtin:tiny"), copy)
    models = [{"name": "tiny", "path": "builtin:tiny"}, {"name": "copy", "path": str(copy)}]
    actors = {"count": 1, "num_cpus": 3, "shards_in_flight": 1}  # 3 of the head's 4 CPUs: room for one replica
    spec = spec_file(tmp_path / "pool.yaml", models, actors, max_samples=25)
    with head as (address, http):  # the two models share the one replica
        up = cli("pool", "up", spec, "--http-port", str(http), address=address)
        assert up.returncode == 0, up.stderr[-3000:]
        assert "models tiny, copy share each replica's GPU share" in up.stdout
        out = tmp_path / "results"
        run = cli("run", spec, "--output", str(out), "--address", address, address=address)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "pool serves model(s) tiny, copy" in run.stdout
        results = pq.read_table(out / "results").to_pylist()
        for model in ("tiny", "copy"):
            ids = [r["sample_id"] for r in results if r["model"] == model]
            assert len(ids) == len(set(ids)) == 150
        assert not (out / "telemetry" / "actors.parquet").exists()  # no engine started for the sweep
        shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pylist()
        assert {s["served_by"] for s in shards} == {shards[0]["served_by"]}  # the one replica
        switches = pq.read_table(out / "telemetry" / "switches.parquet").to_pylist()
        # grouped: copy (awake after start-up) runs its shards, one switch, then tiny's; a few more where a
        # model's next shard reached the replica after its last one finished
        assert 1 <= len(switches) <= 3, [(s["slept_model"], s["model"]) for s in switches]
        assert switches[0]["slept_model"] == "copy" and switches[0]["model"] == "tiny"
        assert all(s["sleep_s"] >= 0 and s["wake_s"] >= 0 and s["engine"] == "hf" for s in switches)
        order = [s["model"] for s in sorted(shards, key=lambda s: s["pool_sequence"])]
        assert sum(a != b for a, b in zip(order, order[1:])) == len(switches) - (order[0] == "tiny")
        status = cli("pool", "status", address=address)
        assert "(switching: replicas shared with the pool's other models)" in status.stdout
        assert f"{len(switches)} switch(es)" in status.stdout, status.stdout


def test_a_pool_that_does_not_answer_is_said_in_one_line_and_counts_as_none(monkeypatch):
    """Serve lists the pool but its ingress does not answer (a fake of Serve's two calls: a broken ingress
    cannot be made to order here): the sweep is told, and runs on its own actors."""
    from ray import serve

    from cluster.pool import served as pool

    class Status:
        applications = {pool.APP: None}

    def no_answer(name):
        raise RuntimeError("ingress down\nTimeoutError: no reply in 30 s")

    monkeypatch.setattr(serve, "status", lambda: Status())
    monkeypatch.setattr(serve, "get_app_handle", no_answer)
    lines = []
    assert pool.read_pool(lines.append) == {}
    assert lines == ["[raysweep] the engine pool raysweep-pool is on this cluster but did not answer (RuntimeError: "
                     "TimeoutError: no reply in 30 s): the sweep runs on its own actors"]


def test_a_pool_of_another_raysweep_version_is_not_used(monkeypatch):
    """Its replicas take other arguments: a sweep would fail every pooled shard. (Fakes of Serve's calls.)"""
    from ray import serve

    from cluster.pool import served as pool

    class Status:
        applications = {pool.APP: None}

    class Handle:
        class describe:
            @staticmethod
            def remote():
                class Response:
                    @staticmethod
                    def result(timeout_s):
                        return {"spec": "old", "models": []}  # no `protocol`: before this version
                return Response()

    monkeypatch.setattr(serve, "status", lambda: Status())
    monkeypatch.setattr(serve, "get_app_handle", lambda name: Handle())
    lines = []
    assert pool.read_pool(lines.append) == {}
    assert lines == ["[raysweep] the engine pool raysweep-pool was started by another raysweep version: the sweep "
                     "runs on its own actors (`raysweep pool up SPEC` again starts it as this version)"]


@pytest.mark.slow
def test_shards_queued_at_serves_router_or_sent_after_the_pool_is_deleted_come_back_as_pool_gone(ray_local):
    """Serve never fails a request that waits at its router for a replica when the application is deleted
    (it waited forever: the `pool down --force` hang); the sweep's pool client notices the pool is gone."""
    import ray
    from ray import serve

    from cluster.contracts.pool_protocol import APP, CLIENT_NAMESPACE, PoolGone
    from cluster.pool.client import PoolClient

    class FakeSlowReplica:  # defined here so that Ray pickles it by value (workers cannot import tests/)
        """Stands in for PoolReplica (an engine is beside the point here): one shard at a time, each taking
        3 s, so the shards after the first wait at Serve's router."""

        async def run_shard(self, shard, task, attempt, sweep, model):
            import asyncio

            await asyncio.sleep(3)
            return "done"

    serve.start(http_options={"port": free_port()})
    try:
        app = serve.deployment(FakeSlowReplica).options(name="model-fake", max_ongoing_requests=1,
                                                        ray_actor_options={"num_cpus": 0}).bind()
        serve.run(app, name=APP, route_prefix="/fake")
        client = ray.remote(PoolClient).options(namespace=CLIENT_NAMESPACE, num_cpus=0).remote("s")
        refs = [client.run_shard.remote("model-fake", "fake", i, None, 1) for i in range(4)]
        time.sleep(1.0)  # the first is at the replica, the others queued at the router
        started = time.monotonic()
        serve.delete(APP, _blocking=False)
        outcomes = []
        for ref in refs:
            try:
                outcomes.append(ray.get(ref, timeout=60))
            except Exception as e:  # RayTaskError(PoolGone) is an instance of PoolGone
                outcomes.append(type(e).__name__ if not isinstance(e, PoolGone) else "PoolGone")
        waited = time.monotonic() - started
        assert outcomes.count("PoolGone") >= 3 and set(outcomes) <= {"PoolGone", "done"}, outcomes
        print(f"pool gone noticed after {waited:.1f}s")  # ray.get's timeout bounds a hang
        # a shard sent once the pool is gone
        with pytest.raises(PoolGone):
            ray.get(client.run_shard.remote("model-fake", "fake", 9, None, 1), timeout=60)
    finally:
        serve.shutdown()


def _get(ingress, path: str, text: bool = False):
    """The pool ingress's HTTP answer to GET `path`, without Serve (the ingress is a plain class)."""
    import asyncio

    from starlette.requests import Request

    response = asyncio.run(ingress(Request({"type": "http", "method": "GET", "path": path, "headers": []})))
    return response.status_code, response.body.decode() if text else json.loads(response.body)


def test_two_sweeps_of_one_name_keep_two_records_and_a_silent_run_shows_as_gone(monkeypatch):
    """The HTTP API keyed sweeps by name (two at once shared one record), and a pooled sweep whose driver was
    killed said "running" forever."""
    from cluster.pool.ingress import PoolIngress

    ingress, now = PoolIngress({}), [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    ingress.record("same-aaaa", {"name": "same", "state": "running", "samples_done": 5, "samples_total": 10})
    now[0] += 1
    ingress.record("same-bbbb", {"name": "same", "state": "running", "samples_done": 1, "samples_total": 10})
    status, runs = _get(ingress, "/raysweep/sweeps")
    assert status == 200 and sorted((r["run_id"], r["name"], r["samples_done"]) for r in runs) == \
        [("same-aaaa", "same", 5), ("same-bbbb", "same", 1)]
    assert _get(ingress, "/raysweep/sweeps/same-aaaa")[1]["samples_done"] == 5
    assert _get(ingress, "/raysweep/sweeps/same")[1]["run_id"] == "same-bbbb"  # a name: its latest run
    now[0] += PoolIngress.GONE_AFTER_S - 0.5
    ingress.record("same-bbbb", {"name": "same", "state": "done", "samples_done": 10, "samples_total": 10})
    now[0] += 1  # same-aaaa silent for longer than GONE_AFTER_S while running: its driver is gone
    states = {r["run_id"]: r["state"] for r in _get(ingress, "/raysweep/sweeps")[1]}
    assert states == {"same-aaaa": "gone", "same-bbbb": "done"}
    assert _get(ingress, "/raysweep/sweeps/same-aaaa")[1]["state"] == "gone"
    assert _get(ingress, "/raysweep/sweeps/nope")[0] == 404


def test_the_live_page_lists_the_runs_and_serves_each_ones_report_reloading_while_it_runs(tmp_path):
    from cluster.pool.ingress import PoolIngress
    from tests.test_report import _qa_output

    ingress = PoolIngress({"models": [{"name": "tiny"}]})
    assert "No sweep has used this pool yet." in _get(ingress, "/raysweep/", text=True)[1]
    out = _qa_output(tmp_path / "out", "nightly", {"tiny": [1, 0, 1], "small": [1, 1, 1]})
    ingress.record("nightly-aaaa", {"name": "nightly", "state": "running", "output": str(out), "samples_done": 3,
                                    "samples_total": 6})
    ingress.record("elsewhere-bbbb", {"name": "elsewhere", "state": "done", "output": "/nowhere/out"})
    status, page = _get(ingress, "/raysweep/", text=True)
    assert status == 200 and 'http-equiv="refresh"' in page  # a run is running: the page reloads
    assert 'href="/raysweep/sweeps/nightly-aaaa/report"' in page and "<td>3 of 6</td>" in page
    status, report = _get(ingress, "/raysweep/sweeps/nightly/report", text=True)
    assert status == 200 and "<h1>raysweep report: nightly</h1>" in report and 'http-equiv="refresh"' in report
    assert '<table id="comparison">' in report and '<script type="application/json" id="samples-data">' in report
    status, page = _get(ingress, "/raysweep/sweeps/elsewhere/report", text=True)
    assert status == 404 and "raysweep report /nowhere/out" in page and 'http-equiv="refresh"' not in page
