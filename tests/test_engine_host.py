"""The engine host of a local run (actors/engine_host.py): an actor's engine runs in a process forked from it,
gives the same rows as an engine in the actor's own process, and never outlives its actor; an actor whose
engine process dies ends too (so the scheduler retries its shards). "Actors" here are plain processes that
do what EvalActor does with the host: the host's part needs no Ray."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

# an actor's part: connect, start the CPU engine on builtin:tiny, run two rows, say what came back, then wait
ACTOR = """
import json, os, sys, time
from actors.hosted_engine import connect
from actors.engine import EngineProfile
from cluster.contracts.engine_host import EngineHostAddress
from cluster.contracts.spec import ModelSpec, TaskSpec, SamplingSpec

path, host_pid, model_path, then, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
process = connect(EngineHostAddress(path, host_pid))
if process is None:
    print(json.dumps({"hosted": False}), flush=True)
    sys.exit(0)
engine = process.start_engine(model=ModelSpec("tiny", "builtin:tiny", backend="hf"), model_path=model_path,
                              profile=EngineProfile(), num_threads=1, gpu_fraction=1.0, sleep_mode=False,
                              reproducible=False)
done = engine.run_rows(rows, TaskSpec("t", "d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=6)), True)
print(json.dumps({"hosted": True, "engine_pid": process.pid, "kind": engine.kind, "env": os.environ.get("RAYSWEEP_PROBE"),
                  "startup": sorted(engine.startup()), "texts": [r["output_text"] for r in done.rows],
                  "tokens": [r["output_tokens"] for r in done.rows]}), flush=True)
if then == "close":
    engine.close()
    process.close()
    print("closed", flush=True)
time.sleep(600)
"""


@pytest.fixture
def host():
    from cluster.launch import EngineHost

    started = EngineHost(["hf"])
    yield started
    started.stop()


def _rows(tokenizer) -> list[dict]:
    prompts = ["2+2=", "The sky is"]
    return [{"sample_id": str(i), "prompt": p, "prompt_token_ids": None, "seed": i, "status": "ok",
             "prompt_tokens": len(tokenizer(p, add_special_tokens=True)["input_ids"])} for i, p in enumerate(prompts)]


def _actor(host, tiny_path, engine, then="wait"):
    return subprocess.Popen([sys.executable, "-c", ACTOR, host.address.path, str(host.address.host_pid),
                             tiny_path, then, json.dumps(_rows(engine.tokenizer))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"RAYSWEEP_PROBE": "from-the-actor", "PYTHONPATH": str(ROOT)})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_an_engine_process_runs_the_actors_rows_and_dies_with_the_actor(host, tiny_path, hf_engine):
    from actors.shard_work import run_rows
    from cluster.contracts.spec import SamplingSpec, TaskSpec

    actor = _actor(host, tiny_path, hf_engine)
    said = json.loads(actor.stdout.readline() or "{}")
    assert said.get("hosted"), actor.stderr.read() if actor.poll() is not None else said
    assert said["kind"] == "hf" and said["env"] == "from-the-actor"  # the actor's environment, not the host's
    assert "engine_init_s" in said["startup"]
    # the same rows through the same engine in this process: the same completions
    here = run_rows(hf_engine, _rows(hf_engine.tokenizer), TaskSpec("t", "d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=6)),
                    hf_engine.tokenizer, True)
    assert said["texts"] == [r["output_text"] for r in here.rows] and said["tokens"] == [r["output_tokens"] for r in here.rows]
    engine_pid = said["engine_pid"]
    assert _alive(engine_pid)
    actor.kill()  # as Ray kills an actor, or a crash
    actor.wait()
    assert _gone_within(engine_pid, 10), "the engine process outlived its actor"
    assert host.process.poll() is None  # the host serves the next actor
    second = _actor(host, tiny_path, hf_engine, then="close")
    try:
        said = json.loads(second.stdout.readline() or "{}")
        assert said.get("hosted") and second.stdout.readline().strip() == "closed"
        assert _gone_within(said["engine_pid"], 10), "a closed engine process stayed"
    finally:
        second.kill()
        second.wait()


def test_an_actor_ends_when_its_engine_process_dies(host, tiny_path, hf_engine):
    actor = _actor(host, tiny_path, hf_engine)
    try:
        said = json.loads(actor.stdout.readline() or "{}")
        assert said.get("hosted")
        os.kill(said["engine_pid"], signal.SIGKILL)  # as an engine that broke exits its process
        assert actor.wait(timeout=20) == 1
        assert f"engine process {said['engine_pid']} ended: this actor ends with it" in actor.stderr.read()
    finally:
        actor.kill()
        actor.wait()


def test_without_a_host_on_its_machine_an_actor_runs_its_engine_itself(tmp_path, tiny_path):
    from actors.hosted_engine import connect
    from cluster.contracts.engine_host import EngineHostAddress

    assert connect(None) is None
    assert connect(EngineHostAddress(str(tmp_path / "no-such.sock"), os.getpid())) is None


def test_the_host_goes_with_the_driver(tmp_path):
    """The driver killed (kill -9): its engine host does not stay behind, importing or holding memory."""
    driver = subprocess.Popen([sys.executable, "-c", "from cluster.launch import EngineHost; import sys, time; "
                               "h = EngineHost(['fake']); print(h.process.pid, flush=True); time.sleep(600)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        host_pid = int(driver.stdout.readline())
        assert _alive(host_pid)
        driver.kill()
        driver.wait()
        assert _gone_within(host_pid, 10), "the engine host outlived its driver"
    finally:
        driver.kill()
        driver.wait()
