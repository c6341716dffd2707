"""Engines started before Ray (cluster/plan/prestart.py): the engines a driver asks its engine host for, from the
spec and the GPUs Ray will find; the host builds each at once and hands it to the first actor that comes with its
GPUs, which takes the engine where it asks for the same start and starts its own where not; and a whole CPU sweep
whose actors took engines started ahead (`RAYSWEEP_PRESTART=1`)."""

import json
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import yaml

from cluster.contracts.engine_host import Prestart, engine_start
from cluster.inputs.spec_file import load_spec
from cluster.plan.prestart import SWITCH, prestarts
from tests.conftest import ROOT, lean_quickstart

H100S = (["0", "1", "2", "3"], "H100")
MANY_TOKENS = 8_000_000  # 2M new tokens per GPU of four: four engines share each GPU (engines_per_gpu.py)


def _spec(tmp_path, model_path: str, models: int = 1, **fields):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "1", "q": "2+2="}\n')
    raw = {"name": "ahead", "models": [{"name": f"m{i}", "path": model_path} for i in range(models)],
           "tasks": [{"name": "t", "data": str(data), "prompt": "{q}"}], **fields}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_spec(path)


def test_four_engines_on_each_of_four_gpus_are_started_ahead_one_per_actor(tmp_path, tiny_path, monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    spec = _spec(tmp_path, tiny_path)
    ahead = prestarts(spec, MANY_TOKENS, gpus=H100S)
    assert [a.gpus for a in ahead] == [g for g in "0123" for _ in range(4)]
    assert {(a.num_cpus, a.num_gpus, a.gpus_on_node, a.model_path) for a in ahead} == {(1.0, 0.25, 4, tiny_path)}
    # the start each engine is built with is the one its actor asks for (actors/evaluator.py uses engine_start)
    assert ahead[0].start() == engine_start(spec.models[0], tiny_path, 1.0, 0.25)
    # a smaller sweep gets two engines per GPU, as the run chooses once Ray is up
    assert [a.gpus for a in prestarts(spec, 1000, gpus=H100S)] == [g for g in "0123" for _ in range(2)]
    # three actors asked for: three engines, on the first GPU's shares
    counted = _spec(tmp_path, tiny_path, actors={"count": 3})
    assert [a.gpus for a in prestarts(counted, MANY_TOKENS, gpus=H100S)] == ["0", "0", "0"]


def test_no_engine_is_started_ahead_where_the_run_cannot_be_known(tmp_path, tiny_path, monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert prestarts(_spec(tmp_path, tiny_path, models=2), MANY_TOKENS, gpus=H100S) == []  # which model first
    assert prestarts(_spec(tmp_path, tiny_path, reproducible=True), MANY_TOKENS, gpus=H100S) == []
    assert prestarts(_spec(tmp_path, "builtin:large"), MANY_TOKENS, gpus=H100S) == []  # not built: the planner's
    tp = _spec(tmp_path, tiny_path)
    object.__setattr__(tp.models[0], "engine", {"tensor_parallel_size": 2})
    assert prestarts(tp, MANY_TOKENS, gpus=H100S) == []
    assert prestarts(_spec(tmp_path, tiny_path), MANY_TOKENS, gpus=([], None)) == []  # no GPU: by default none
    monkeypatch.setenv(SWITCH, "0")
    assert prestarts(_spec(tmp_path, tiny_path), MANY_TOKENS, gpus=H100S) == []
    monkeypatch.setenv(SWITCH, "1")  # the CPU engine too: one per actor, on no GPU
    cpu = prestarts(_spec(tmp_path, tiny_path, actors={"count": 2}), MANY_TOKENS, gpus=([], None))
    assert [(a.gpus, a.num_gpus) for a in cpu] == [("", 0.0), ("", 0.0)]


# an actor's part: connect, start the CPU engine on builtin:tiny with THREADS threads, run two rows, say where the
# engine came from, then wait to be killed
ACTOR = """
import json, sys, time
from actors.hosted_engine import connect
from actors.engine import EngineProfile
from cluster.contracts.engine_host import EngineHostAddress
from cluster.contracts.spec import ModelSpec, TaskSpec, SamplingSpec

path, host_pid, model_path, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
process = connect(EngineHostAddress(path, host_pid))
engine = process.start_engine(model=ModelSpec("tiny", "builtin:tiny", backend="hf"), model_path=model_path,
                              profile=EngineProfile(), num_threads=threads, gpu_fraction=1.0, sleep_mode=False,
                              reproducible=False)
from transformers import AutoTokenizer
tokens = AutoTokenizer.from_pretrained(model_path)
rows = [{"sample_id": str(i), "prompt": p, "prompt_token_ids": None, "seed": i, "status": "ok",
         "prompt_tokens": len(tokens(p)["input_ids"])} for i, p in enumerate(["2+2=", "The sky is"])]
done = engine.run_rows(rows, TaskSpec("t", "d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=4)), True)
print(json.dumps({"pid": process.pid, "where": engine.startup()["engine_process"],
                  "status": [r["status"] for r in done.rows]}), flush=True)
time.sleep(600)
"""


def _children(pid: int) -> set[int]:
    found = set()
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(child))
    return found


def _actor_says(host, tiny_path, threads: int, log) -> tuple[subprocess.Popen, dict]:
    from tests.test_engine_host import _line

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"PYTHONPATH": str(ROOT)}
    actor = subprocess.Popen([sys.executable, "-c", ACTOR, host.address.path, str(host.address.host_pid), tiny_path,
                              str(threads)], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    return actor, json.loads(_line(actor) or "{}")


@pytest.mark.slow
def test_the_host_hands_an_engine_started_ahead_to_the_actor_that_asks_for_it(tiny_path, tmp_path):
    from cluster.contracts.spec import ModelSpec
    from cluster.launch import EngineHost

    host = EngineHost(["hf"])
    model = ModelSpec("tiny", "builtin:tiny", backend="hf")
    actors = []
    log = open(tmp_path / "actors.log", "w")
    try:
        host.prestart([Prestart("", 1.0, 0.0, 0, model, tiny_path), Prestart("", 2.0, 0.0, 0, model, tiny_path)])
        deadline = time.monotonic() + 120
        while len(_children(host.process.pid)) < 2 and time.monotonic() < deadline:  # both building, no actor yet
            time.sleep(0.2)
        ahead = _children(host.process.pid)
        assert len(ahead) == 2, (tmp_path / "actors.log").read_text()[-2000:]
        # the first actor asks for the first engine's start: it takes that engine, in that process
        actor, said = _actor_says(host, tiny_path, 1, log)
        actors.append(actor)
        assert said.get("where") == "prestarted" and said["pid"] in ahead, (tmp_path / "actors.log").read_text()[-3000:]
        assert said["status"] == ["ok", "ok"]
        # the second asks for one thread, the engine left ahead was built with two: closed, its own started there
        actor, second = _actor_says(host, tiny_path, 1, log)
        actors.append(actor)
        assert second.get("where") == "host" and second["pid"] in ahead and second["status"] == ["ok", "ok"]
        # none left ahead: the third gets a process forked as before
        actor, third = _actor_says(host, tiny_path, 1, log)
        actors.append(actor)
        assert third.get("where") == "host" and third["pid"] not in ahead
    finally:
        for actor in actors:
            actor.kill()
            actor.wait()
        host.stop()


@pytest.mark.slow
def test_an_engine_started_ahead_and_not_claimed_goes_with_the_host(tiny_path):
    from cluster.contracts.spec import ModelSpec
    from cluster.launch import EngineHost
    from tests.test_engine_host import _gone_within

    host = EngineHost(["hf"])
    try:
        one = Prestart("", 1.0, 0.0, 0, ModelSpec("tiny", "builtin:tiny", backend="hf"), tiny_path)
        host.prestart([one])
        host.prestart([one])  # a later sweep of the same command: its engines run in the actors it kept
        deadline = time.monotonic() + 120
        while not _children(host.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # a second engine, had one been asked for, would be forked by now
        ahead = _children(host.process.pid)
        assert len(ahead) == 1
    finally:
        host.stop()
    assert all(_gone_within(pid, 10) for pid in ahead), "an engine started ahead outlived its host"


@pytest.mark.slow
def test_a_cpu_sweep_runs_on_engines_started_ahead(tmp_path, tiny_path):  # tiny built: started ahead
    from tests.test_sweep import _host_processes_left, expected_ids

    spec = lean_quickstart(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", str(spec), "--output", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"RAY_ADDRESS": "local", SWITCH: "1"})
    stderr = proc.communicate(timeout=600)[1]
    assert proc.returncode == 0, stderr[-3000:]
    results = pq.read_table(out / "results").to_pandas()
    keys = list(zip(results["task"].astype(str), results["sample_id"]))
    assert len(keys) == len(set(keys)) and set(keys) == expected_ids(load_spec(spec))
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    first = actors[actors["start_index"] == 0]
    assert len(first) == 2 and set(first["engine_process"]) == {"prestarted"}, actors.to_string()
    assert _host_processes_left(proc.pid) == []
