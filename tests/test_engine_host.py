"""The engine host of a local run (actors/engine_host.py): an actor's engine runs in a process forked from it,
with the actor's environment, gives the same rows as an engine in the actor's own process, and never outlives
its actor, nor do the processes it forks; an actor whose engine process dies ends too (so the scheduler retries
its shards). "Actors" here are plain processes that do what EvalActor does with the host: the host's part needs
no Ray."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
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
done = engine.run_rows(rows, TaskSpec("t", "d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=6), fail_on_error=False), True)
print(json.dumps({"hosted": True, "engine_pid": process.pid, "kind": engine.kind, "startup": sorted(engine.startup()),
                  "status": [r["status"] for r in done.rows], "texts": [r["output_text"] for r in done.rows],
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
    prompts = ["2+2=", "The sky is", "Once upon"]
    return [{"sample_id": str(i), "prompt": p, "prompt_token_ids": None, "seed": i, "status": "ok",
             "prompt_tokens": len(tokenizer(p, add_special_tokens=True)["input_ids"])} for i, p in enumerate(prompts)]


def _actor(host, tiny_path, engine, log, then="wait"):
    """An actor whose environment makes sample "1" fail in every engine call (shard_work's test switch): a
    row that fails in the engine process shows it runs with the actor's environment, not the host's."""
    return subprocess.Popen([sys.executable, "-c", ACTOR, host.address.path, str(host.address.host_pid),
                             tiny_path, then, json.dumps(_rows(engine.tokenizer))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=os.environ | {"RAYSWEEP_TEST_FAIL_SAMPLES": "1", "PYTHONPATH": str(ROOT)})


_LINES: dict = {}  # process -> the queue its reader thread puts its stdout lines in


def _line(process, timeout_s: float = 120) -> str:
    """The process's next stdout line; '' if none comes in time (a hang fails the test, not the suite). A thread
    reads them: a select on the pipe misses a line that an earlier readline took into its buffer with the one
    before (two lines written at once, on a busy machine), and waited out its whole bound for it."""
    lines = _LINES.get(process)
    if lines is None:
        lines = _LINES[process] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return ""


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


@pytest.mark.slow
def test_an_engine_process_runs_the_actors_rows_and_dies_with_the_actor(host, tiny_path, hf_engine, tmp_path):
    from actors.shard_work import run_rows
    from cluster.contracts.spec import SamplingSpec, TaskSpec

    log = open(tmp_path / "actor.log", "w")
    actor = _actor(host, tiny_path, hf_engine, log)
    said = json.loads(_line(actor) or "{}")
    assert said.get("hosted"), (tmp_path / "actor.log").read_text()[-3000:]
    assert said["kind"] == "hf" and "engine_init_s" in said["startup"]
    # the actor's environment reached the engine process: sample 1 failed there, its neighbours did not
    assert said["status"] == ["ok", "error", "ok"], said
    # the same rows through the same engine in this process: the same completions
    here = run_rows(hf_engine, _rows(hf_engine.tokenizer),
                    TaskSpec("t", "d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=6)), hf_engine.tokenizer, True)
    for i in (0, 2):
        assert (said["texts"][i], said["tokens"][i]) == (here.rows[i]["output_text"], here.rows[i]["output_tokens"])
    engine_pid = said["engine_pid"]
    assert _alive(engine_pid)
    actor.kill()  # as Ray kills an actor, or a crash
    actor.wait()
    assert _gone_within(engine_pid, 10), "the engine process outlived its actor"
    assert host.process.poll() is None  # the host serves the next actor
    second = _actor(host, tiny_path, hf_engine, log, then="close")
    try:
        said = json.loads(_line(second) or "{}")
        assert said.get("hosted") and _line(second).strip() == "closed"
        assert _gone_within(said["engine_pid"], 10), "a closed engine process stayed"
    finally:
        second.kill()
        second.wait()


@pytest.mark.slow
def test_an_actor_ends_when_its_engine_process_dies(host, tiny_path, hf_engine, tmp_path):
    log = open(tmp_path / "actor.log", "w")
    actor = _actor(host, tiny_path, hf_engine, log)
    try:
        said = json.loads(_line(actor) or "{}")
        assert said.get("hosted"), (tmp_path / "actor.log").read_text()[-3000:]
        os.kill(said["engine_pid"], signal.SIGKILL)  # as an engine that broke exits its process
        assert actor.wait(timeout=20) == 1
        assert f"engine process {said['engine_pid']} ended: this actor ends with it" in (tmp_path / "actor.log").read_text()
    finally:
        actor.kill()
        actor.wait()


# an engine process's part: its guard set up, then a child forked (as vLLM forks its engine core) that would
# sleep on, holding the actor's connection; then the engine process dies as a broken engine makes it (os._exit)
GUARDED = """
import os, socket, sys, time
from actors.engine_process import guard_group
fd = int(sys.argv[1])
os.setsid()
guard_group(fd)
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
os.write(1, f"{child}\\n".encode())
time.sleep(0.5)
os._exit(1)
"""


def test_what_an_engine_process_forked_goes_with_it_and_lets_go_of_the_actor():
    """vLLM's engine core, forked outside Ray, has no parent-death check: when the engine process dies
    another way than by its actor's going, its watchdog kills the group, and the actor's connection ends."""
    import socket

    actor_end, engine_end = socket.socketpair()
    engine = subprocess.Popen([sys.executable, "-c", GUARDED, str(engine_end.fileno())], cwd=ROOT,
                              pass_fds=[engine_end.fileno()], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": str(ROOT)})
    engine_end.close()
    try:
        child = int(_line(engine, 60) or 0)
        assert child
        assert engine.wait(timeout=30) == 1
        actor_end.settimeout(10)
        assert actor_end.recv(1) == b"", "the actor's connection stayed open in a child of the engine process"
        assert _gone_within(child, 10), "a child of the engine process outlived it"
    finally:
        engine.kill()
        engine.wait()
        actor_end.close()


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


def test_a_killed_drivers_host_folder_is_removed_by_the_next_host(tmp_path):
    """kill -9 leaves a host's folder (its socket and log): the next host removes those of drivers no longer
    running, and keeps a running driver's and what is not a host's."""
    from cluster.launch import FOLDER_PREFIX, remove_stale_folders

    gone = subprocess.Popen(["true"])
    gone.wait()
    for name in (f"{FOLDER_PREFIX}{gone.pid}-abc", f"{FOLDER_PREFIX}{os.getpid()}-def", f"{FOLDER_PREFIX}other"):
        (tmp_path / name).mkdir()
    remove_stale_folders(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{FOLDER_PREFIX}{os.getpid()}-def", f"{FOLDER_PREFIX}other"]


def test_an_engine_here_and_an_engine_in_an_engine_process_answer_the_same_calls():
    """The actor starts, runs and lets go of engines the same way wherever they run (actors/local_engine.py,
    actors/hosted_engine.py): the two places and the two kinds of engine offer the same calls."""
    import inspect

    from actors.hosted_engine import EngineProcess, HostedEngine
    from actors.local_engine import InProcess, LocalEngine

    def calls(cls) -> set[str]:
        return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}

    assert {"start_engine", "close"} <= calls(InProcess) & calls(EngineProcess)
    assert (InProcess.where, EngineProcess.where) == ("actor", "host")
    assert calls(LocalEngine) == calls(HostedEngine) == {"run_rows", "startup", "sleep", "wake_up", "swap_weights",
                                                           "close"}
    assert inspect.signature(InProcess.start_engine).parameters.keys() == \
        inspect.signature(EngineProcess.start_engine).parameters.keys()


# what the host does before it forks (actors/engine_host.py), then what an engine process does for the
# quickstart's builtin:tiny: start the CPU engine and generate under a grammar; prints the modules it imported
PRELOADED = """
import sys
from actors.engine_factory import make_engine, preload
from actors.engine import EngineProfile, GenRequest
from cluster.contracts.spec import ModelSpec, SamplingSpec
from cluster.contracts.task_spec import StructuredSpec

preload(["hf"], core_process=False)
import actors.engine_process
before = set(sys.modules)
engine = make_engine(ModelSpec("tiny", "builtin:tiny", backend="hf"), sys.argv[1], EngineProfile(), num_threads=1)
engine.generate([GenRequest("0", [1, 2, 3], 0)], SamplingSpec(max_tokens=3), StructuredSpec("choice", ("A", "B")))
print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("torch", "transformers", "xgrammar")))
"""


def test_an_engine_forked_from_the_host_imports_nothing_the_host_could_have():
    """The host imports what the CPU engine of the builtin models needs before it forks: transformers imports a
    model's classes on first use, and each forked engine would import them again (3-4 CPU-seconds on a 2-core
    machine)."""
    import ast

    from cluster.inputs.builtin_model import resolve_model_path

    done = subprocess.run([sys.executable, "-c", PRELOADED, resolve_model_path("builtin:tiny")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert ast.literal_eval(done.stdout.strip().splitlines()[-1]) == []


def test_a_cluster_is_on_this_machine_where_every_live_node_runs_here_and_no_autoscaler_can_add_one(ray_local,
                                                                                                   monkeypatch):
    """What decides an engine host for a run that joins a cluster (jobs/lifecycle.py `_host_for_cluster`): the
    session's local Ray is on this machine; a live node elsewhere, or an autoscaler that may start one, is not."""
    from cluster.launch import cluster_on_this_machine

    assert cluster_on_this_machine()
    nodes = ray_local.nodes()
    elsewhere = {**nodes[0], "NodeManagerAddress": "198.51.100.7"}
    monkeypatch.setattr("ray.nodes", lambda: nodes + [elsewhere])
    assert not cluster_on_this_machine()
    monkeypatch.setattr("ray.nodes", lambda: nodes + [{**elsewhere, "Alive": False}])
    assert cluster_on_this_machine()  # a dead node takes no actor
    monkeypatch.setattr("cluster.plan.placement.read_node_types", lambda gcs_port: [{"CPU": 4, "GPU": 1}])
    assert not cluster_on_this_machine()
