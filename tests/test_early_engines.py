"""Early engines (cluster/plan/early_engines.py, cluster/contracts/engine_host.py): which a local run asks its
engine host for before Ray is up, and what the host makes of them — the engine is built before any actor asks, the
actor of its key that asks for the same engine gets that one, an actor that asks for another gets that other, and
one no actor takes ends once the driver lets go of it. The host's part needs no Ray: "actors" here are plain
processes that do what EvalActor does with the host."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from cluster.contracts.engine_host import CPU_KEY, early_path, engine_key
from cluster.contracts.spec import ActorSpec, ModelSpec, SweepSpec, TaskSpec
from cluster.plan.early_engines import EarlyEngine, local_gpus, plan_early
from cluster.plan.engines_per_gpu import SMALL_WEIGHTS_BYTES
from tests.conftest import ROOT

LARGE = SMALL_WEIGHTS_BYTES * 6


def _spec(models=None, reproducible: bool = False, **actors) -> SweepSpec:
    return SweepSpec(name="e", models=models or [ModelSpec("m", "/models/m")],
                     tasks=[TaskSpec("t", "d.jsonl", prompt="{q}")], output="/out", actors=ActorSpec(**actors),
                     reproducible=reproducible)


def test_an_8b_model_on_four_gpus_gets_one_early_engine_per_gpu_as_its_actors_will_start_it():
    plan = plan_early(_spec(), "/models/m", ["0", "1", "2", "3"], LARGE)
    assert (plan.model, plan.count, plan.num_gpus, plan.num_cpus) == ("m", 4, 1.0, 1.0)
    assert [e.key for e in plan.engines] == ["0", "1", "2", "3"]
    assert [e.env for e in plan.engines] == [{"CUDA_VISIBLE_DEVICES": g} for g in "0123"]
    # actors/evaluator.py _start_engine's arguments, but the profile (the host adds the default one)
    assert plan.engines[0].start == {"model": ModelSpec("m", "/models/m"), "model_path": "/models/m", "num_threads": 1,
                                     "gpu_fraction": 1.0, "sleep_mode": False, "reproducible": False}
    assert plan.engines[0].threads == (1.0, 1.0, 4)
    assert [e.key for e in plan_early(_spec(), "/models/m", ["2", "3"], LARGE).engines] == ["2", "3"]


@pytest.mark.parametrize("spec, gpus, weights", [
    (_spec(), ["0", "1"], SMALL_WEIGHTS_BYTES),  # a small model: the GPU's memory decides, once Ray says the GPU
    (_spec(), ["0", "1"], None),  # a size not known
    (_spec(num_gpus=2), ["0", "1"], LARGE),  # an actor of two GPUs
    (_spec(num_gpus=0.5, count=3), ["0", "1"], LARGE),  # fewer actors than the GPUs' shares
    (_spec(count=1), ["0", "1"], LARGE),  # fewer actors than GPUs: which GPU Ray gives is not known
    (_spec([ModelSpec("a", "/a"), ModelSpec("b", "/b")]), ["0"], LARGE),  # which model an actor starts first
    (_spec([ModelSpec("m", "/m", engine={"tensor_parallel_size": 2})]), ["0", "1"], LARGE),  # one engine, two GPUs
    (_spec(count=2), [], None),  # two CPU actors
])
def test_no_early_engine_where_an_actors_first_engine_is_not_known_before_ray(spec, gpus, weights):
    assert plan_early(spec, "/models/m", gpus, weights) is None


def test_a_large_model_on_gpus_the_rule_shares_between_two_engines_gets_an_early_engine_per_actor():
    # 8B (13 GiB) on an H200's 140 GiB, log-likelihoods asked (compiled engines): two engines per GPU once Ray is up
    # (cluster/plan/engines_per_gpu.py); a generation sweep's uncompiled engines: one per GPU, as the rule gives them
    h200, h100 = 143771 << 20, 81559 << 20
    compiled = _spec([ModelSpec("m", "/models/m", loglikelihood=True)])
    plan = plan_early(compiled, "/models/m", ["0", "1"], 13 << 30, h200)
    assert (plan.count, plan.num_gpus) == (4, 0.5)
    assert [(e.key, e.slot) for e in plan.engines] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert {e.start["gpu_fraction"] for e in plan.engines} == {0.5} and plan.engines[0].threads == (1.0, 0.5, 2)
    assert plan_early(compiled, "/models/m", ["0", "1"], 13 << 30, h100).count == 2
    uncompiled = plan_early(_spec(), "/models/m", ["0", "1"], 13 << 30, h200)
    assert (uncompiled.count, uncompiled.num_gpus) == (2, 1.0)
    assert plan_early(_spec(num_gpus=1), "/models/m", ["0", "1"], 13 << 30, h200).count == 2  # as the spec asks
    assert plan_early(_spec(num_gpus=0.25), "/models/m", ["0"], SMALL_WEIGHTS_BYTES).count == 4  # as the spec asks
    assert plan_early(_spec(num_gpus=0.3), "/models/m", ["0"], LARGE).count == 3  # as many as fit, as Ray packs them


def test_engines_that_share_a_gpu_and_start_one_at_a_time_are_not_built_early(monkeypatch):
    monkeypatch.setenv("RAYSWEEP_SHARED_GPU_START", "serial")  # vLLM measures free memory: no neighbour may move it
    assert plan_early(_spec(num_gpus=0.5), "/models/m", ["0"], LARGE) is None
    assert plan_early(_spec(num_gpus=1), "/models/m", ["0"], LARGE).count == 1


def test_whole_gpus_as_the_spec_asks_them_and_one_cpu_actor_get_early_engines():
    assert plan_early(_spec(num_gpus=1, count=2), "/m", ["0", "1"], SMALL_WEIGHTS_BYTES).count == 2
    cpu = plan_early(_spec(num_cpus=2), "/m", [], None)
    assert [(e.key, e.env, e.threads) for e in cpu.engines] == [(CPU_KEY, {}, (2.0, 0.0, 0))]
    assert cpu.engines[0].start["num_threads"] == 2 and (cpu.count, cpu.num_gpus) == (1, 0.0)
    assert plan_early(_spec(reproducible=True), "/m", [], None) is None


def test_the_early_engines_are_kept_only_for_the_fleet_they_were_planned_for():
    """Once Ray is up the fleet is sized from what Ray says (cluster/schedule/fleet_size.py): where its actors
    are not those planned, or a pool or an earlier sweep lends the model engines, the early ones are let go of."""
    from cluster.plan.engines_per_gpu import EngineChoice, resolved
    from cluster.plan.placement import ActorResources
    from cluster.schedule.fleet_size import FleetSize

    plan = plan_early(_spec(), "/models/m", ["0", "1", "2", "3"], LARGE)

    def size(count: int, num_gpus: float, num_cpus: float = 1.0) -> FleetSize:
        spec = resolved(_spec(num_cpus=num_cpus), EngineChoice(count, num_gpus, 1, "-"))
        return FleetSize(spec, EngineChoice(count, num_gpus, 1, "-"), {"m": ActorResources(num_cpus, num_gpus, None)},
                         {}, {})

    assert plan.holds(size(4, 1.0), frozenset())
    assert not plan.holds(size(4, 1.0), frozenset({"m"}))
    assert not plan.holds(size(3, 1.0), frozenset())  # Ray saw another number of GPUs
    assert not plan.holds(size(8, 0.5), frozenset())
    assert not plan.holds(size(4, 1.0, num_cpus=2.0), frozenset())


def test_an_actors_key_is_its_gpus_and_the_early_engines_of_a_key_listen_beside_the_host(tmp_path):
    from cluster.contracts.engine_host import EngineHostAddress, claim_early, early_paths

    assert (engine_key(["3"]), engine_key(["0", "1"]), engine_key([])) == ("3", "0,1", CPU_KEY)
    address = EngineHostAddress("/tmp/raysweep-engine-host-1-x/host.sock", 1)
    assert early_path(address, "0,1") == "/tmp/raysweep-engine-host-1-x/early-0-1.0.sock"
    assert early_path(address, "0,1", 1) == "/tmp/raysweep-engine-host-1-x/early-0-1.1.sock"
    here = EngineHostAddress(str(tmp_path / "host.sock"), 1)
    for key, slot in [("0", 1), ("0", 0), ("0,1", 0), ("1", 0)]:
        open(early_path(here, key, slot), "w").close()
    assert early_paths(here, "0") == [early_path(here, "0", 0), early_path(here, "0", 1)]
    first = early_paths(here, "0")[0]
    assert claim_early(first) and not claim_early(first)  # the actor that claims it first takes it, no other
    assert early_paths(here, "0") == [early_path(here, "0", 0), early_path(here, "0", 1)]


def test_the_gpus_a_local_ray_would_give_are_those_cuda_visible_devices_names(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert local_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == []


# an actor's part: connect with its key, start the CPU engine on builtin:tiny with the early engine's arguments
# (or, with "other", two CPU threads), run a row, say where its engine was built and by which process
ACTOR = """
import json, sys
from actors.hosted_engine import connect
from actors.engine import EngineProfile
from cluster.contracts.engine_host import EngineHostAddress
from cluster.contracts.spec import ModelSpec, TaskSpec, SamplingSpec

path, host_pid, model_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
threads, tokens = int(sys.argv[4]), int(sys.argv[5])
process = connect(EngineHostAddress(path, host_pid), "cpu")
engine = process.start_engine(model=ModelSpec("tiny", "builtin:tiny", backend="hf"), model_path=model_path,
                              profile=EngineProfile(), num_threads=threads, gpu_fraction=1.0, sleep_mode=False,
                              reproducible=False)
row = {"sample_id": "0", "prompt": "2+2=", "prompt_token_ids": None, "seed": 0, "status": "ok", "prompt_tokens": tokens}
done = engine.run_rows([row], TaskSpec("t", "d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=4)), True)
print(json.dumps({"where": engine.where, "pid": process.pid, "status": done.rows[0]["status"],
                  "init_s": engine.startup()["engine_init_s"]}), flush=True)
"""


def _early(tiny_path, slot: int = 0) -> EarlyEngine:
    start = {"model": ModelSpec("tiny", "builtin:tiny", backend="hf"), "model_path": tiny_path, "num_threads": 1,
             "gpu_fraction": 1.0, "sleep_mode": False, "reproducible": False}
    return EarlyEngine(CPU_KEY, {}, start, (1.0, 0.0, 0), slot)


def _actor_process(host, tiny_path, tokens: int, threads: int = 1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ACTOR, host.address.path, str(host.address.host_pid), tiny_path,
                             str(threads), str(tokens)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})


def _finished(process: subprocess.Popen) -> str:
    """The actor's stdout once it exited 0 (a bound that catches a hang, not a speed)."""
    try:
        out, err = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, err[-3000:]
    return out


def _actor(host, tiny_path, tokens: int, threads: int = 1) -> dict:
    return json.loads(_finished(_actor_process(host, tiny_path, tokens, threads)).strip().splitlines()[-1])


def _forked(host, timeout_s: float = 120) -> set[int]:
    """The processes the host forked, once it has forked one (its imports done)."""
    deadline = time.monotonic() + timeout_s
    while not (found := _children(host.address.host_pid)):
        assert time.monotonic() < deadline, "the host forked no process for the early engine"
        time.sleep(0.1)
    return found


@pytest.fixture
def host():
    from cluster.launch import EngineHost

    started = EngineHost(["hf"])
    yield started
    started.stop()


def test_the_actor_that_asks_for_the_early_engine_gets_it_and_the_next_actor_a_process_of_its_own(host, tiny_path, hf_engine):
    tokens = len(hf_engine.tokenizer("2+2=")["input_ids"])
    host.start_early([_early(tiny_path)])  # at once: the host still imports, and forks nothing yet
    path = early_path(host.address, CPU_KEY)
    assert os.path.exists(path), "the early engine's socket is not there once the driver asked for it"
    first = _actor(host, tiny_path, tokens)  # comes before the early engine's process exists, and waits for it
    assert (first["where"], first["status"]) == ("early", "ok") and first["init_s"] > 0
    assert not os.path.exists(path)  # taken: the next actor of the key gets a process of its own from the host
    second = _actor(host, tiny_path, tokens)
    assert second["where"] == "host" and second["pid"] != first["pid"]


def test_two_actors_of_one_gpu_at_once_take_its_two_early_engines_one_each(host, tiny_path, hf_engine):
    """Actors that share a GPU share its key: each takes an engine no other has claimed, whatever their order."""
    tokens = len(hf_engine.tokenizer("2+2=")["input_ids"])
    host.start_early([_early(tiny_path, slot) for slot in (0, 1)])
    both = [_actor_process(host, tiny_path, tokens) for _ in range(2)]
    done = [json.loads(_finished(p).strip().splitlines()[-1]) for p in both]
    assert [(d["where"], d["status"]) for d in done] == [("early", "ok")] * 2
    assert done[0]["pid"] != done[1]["pid"]
    assert not os.path.exists(early_path(host.address, CPU_KEY, 0))
    assert not os.path.exists(early_path(host.address, CPU_KEY, 1))


def test_an_actor_that_asks_for_another_engine_gets_that_one_in_the_early_engines_process(host, tiny_path,
                                                                                         hf_engine):
    tokens = len(hf_engine.tokenizer("2+2=")["input_ids"])
    host.start_early([_early(tiny_path)])
    early = _forked(host)  # one process: the early engine's
    other = _actor(host, tiny_path, tokens, threads=2)
    assert (other["where"], other["status"]) == ("host", "ok") and {other["pid"]} == early


def _children(pid: int) -> set[int]:
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry))
    return found


def test_an_early_engine_no_actor_took_ends_once_the_driver_lets_go_of_it(host, tiny_path):
    host.start_early([_early(tiny_path)])
    early = _forked(host)  # one process: the early engine's
    assert len(early) == 1
    host.drop_early()
    assert not os.path.exists(early_path(host.address, CPU_KEY))  # an actor that comes now asks the host
    deadline = time.monotonic() + 30
    while _children(host.address.host_pid) & early:
        assert time.monotonic() < deadline, "the early engine's process outlived the driver's letting go"
        time.sleep(0.2)


SPEC = """\
name: early
models:
  - name: tiny
    path: builtin:tiny
tasks:
  - name: qa
    data: qa.jsonl
    id_column: id
    prompt: "Q: {question}\\nA:"
    sampling: {max_tokens: 4}
"""


@pytest.mark.slow
def test_a_local_sweep_of_one_model_and_one_actor_runs_on_the_engine_built_before_ray_was_up(tmp_path, tiny_path,
                                                                                              monkeypatch):
    """The command as a user runs it: the spec leaves `actors:` out (one CPU actor), the model is on disk; the
    actor's first engine is the early one, every row once, and the command exits 0. Run again into its complete
    output, the same sweep asks its engine host for no early engine and starts no Ray."""
    import pyarrow.parquet as pq

    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "question": f"{i}+{i}"}) + "\n"
                                               for i in range(12)))
    (tmp_path / "sweep.yaml").write_text(SPEC)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "jobs.sweep", str(tmp_path / "sweep.yaml"), "--output", str(out)],
                          cwd=ROOT, env=os.environ | {"RAY_ADDRESS": "local"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    assert list(actors["engine_process"]) == ["early"], actors[["actor_id", "reason", "engine_process"]]
    assert re.search(r"\[raysweep\] engine up: model tiny \(hf\) on actor \w{8}, [\d.]+s after it was asked for, "
                     r"built before Ray was up\n", done.stdout), done.stdout[-3000:]
    assert actors["built_at"].notna().all() and (actors["built_at"] <= actors["ready_at"]).all(), \
        actors[["built_at", "requested_at", "ready_at"]]  # the timeline: built by the host, then taken
    results = pq.read_table(out / "results").to_pandas()
    assert sorted(results["sample_id"]) == sorted(f"r{i}" for i in range(12))
    _rerun_asks_for_nothing(tmp_path / "sweep.yaml", out, monkeypatch)


def _rerun_asks_for_nothing(spec_path, out, monkeypatch) -> None:
    """The sweep of `spec_path` again into its complete output `out`, through the command's lifecycle in this
    process, its engine host a stand-in that records what it is asked: no early engine, no Ray start."""
    import argparse

    from cluster.contracts.timing import RunClock
    from jobs.lifecycle import SweepRun

    class Host:
        address = None

        def __init__(self):
            self.asked, self.stopped = [], 0

        def start_early(self, engines):
            self.asked.extend(engines)

        def stop(self):
            self.stopped += 1

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a sweep with nothing left to run")

    host = Host()
    monkeypatch.setattr("cluster.launch.start_engine_host", lambda backends: host)
    monkeypatch.setattr("cluster.plan.early_engines.local_gpus", lambda: [])  # as on a CPU machine: one early engine
    monkeypatch.setattr("jobs.ray_start.start_ray", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = argparse.Namespace(spec=str(spec_path), output=str(out), address=None, max_attempts=3, dashboard=False,
                              new_run=False, verbose=False)
    with SweepRun(args, RunClock(0.0), log=lambda line: None) as run:
        run.read(str(spec_path))
        run.check()
        run.open(str(out))
        run.start_ray()
        report, node = run.execute(say_stopped=None)
    assert host.asked == [] and host.stopped == 1
    assert (report.shards_run, report.shards_skipped, report.wall_s, node) == (0, 1, None, None)


def test_early_engines_that_cannot_be_asked_for_leave_the_run_to_its_actors(tmp_path, tiny_path, monkeypatch):
    """A socket of an early engine that cannot be bound (its path taken) or a host that went: the run says so in
    one line, lets go of what it asked, and goes on with no early engine (each actor starts its own)."""
    import argparse
    from types import SimpleNamespace

    from cluster.contracts.timing import RunClock
    from cluster.inputs.spec_file import load_spec
    from jobs.lifecycle import SweepRun

    class Host:
        address, dropped = None, 0

        def start_early(self, engines):
            raise OSError(98, "Address already in use")

        def drop_early(self):
            self.dropped += 1

        def stop(self):
            pass

    host = Host()
    monkeypatch.setattr("cluster.launch.start_engine_host", lambda backends: host)
    prepared = SimpleNamespace(sink=SimpleNamespace(close=lambda: None), nothing_left=False)
    monkeypatch.setattr("cluster.schedule.run.prepare", lambda *a, **k: prepared)
    monkeypatch.setattr("cluster.plan.early_engines.local_gpus", lambda: [])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "qa.jsonl").write_text(json.dumps({"id": "r0", "question": "1+1"}) + "\n")
    (tmp_path / "sweep.yaml").write_text(SPEC)
    lines = []
    args = argparse.Namespace(spec=None, output=None, address=None, max_attempts=3, dashboard=False, new_run=True,
                              verbose=False)
    with SweepRun(args, RunClock(0.0), log=lines.append) as run:
        run.adopt(load_spec(tmp_path / "sweep.yaml"))
        run.check()
        run.open(str(tmp_path / "out"))
        assert host.dropped == 1 and run._early is None
    assert [line for line in lines if "no engine started before Ray was up" in line] == [
        "[raysweep] no engine started before Ray was up (OSError: [Errno 98] Address already in use); each actor "
        "starts its own"]
