"""A command's lifecycle (jobs/lifecycle.py SweepRun): each step once (each sweep's, and the process's: the engine
host and Ray, across `raysweep lm-eval`'s sweeps too), and what was started is stopped in one place whatever ends
the run."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from jobs.lifecycle import SweepRun

QUICKSTART = Path(__file__).resolve().parents[1] / "sweeps"


class _Host:
    address = None

    def __init__(self, backends):
        self.backends, self.stopped = backends, 0

    def stop(self):
        self.stopped += 1


def _args(**kw):
    base = dict(spec=None, output=None, address=None, max_attempts=3, dashboard=False, new_run=True, verbose=False)
    return argparse.Namespace(**{**base, **kw})


def _clock():
    from cluster.contracts.timing import RunClock

    return RunClock(0.0)


@pytest.fixture
def hosts(monkeypatch):
    started = []
    monkeypatch.setattr("cluster.launch.start_engine_host", lambda backends: started.append(_Host(backends)) or started[-1])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return started


def test_a_spec_that_does_not_load_stops_the_engine_host_it_started(tmp_path, hosts):
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"name": "x", "models": [{"name": "m", "path": "builtin:tiny"}], "tasks": "nope"}))
    with pytest.raises(ValueError):
        with SweepRun(_args(spec=str(bad)), _clock()) as life:
            life.read(str(bad))
    assert len(hosts) == 1 and hosts[0].stopped == 1


def test_a_reproducible_spec_on_vllm_runs_no_engine_host_and_a_cluster_none_before_ray_is_joined(tmp_path, hosts):
    """A reproducible run's vLLM engines stay in their actors (vLLM's batch-invariant setting is the actor's
    process's); the CPU engine's reproducible runs use the host as any other run."""
    import dataclasses

    from cluster.inputs.spec_file import load_spec

    spec = load_spec(QUICKSTART / "quickstart.yaml")
    with SweepRun(_args(address="ray://head:10001"), _clock()) as life:
        life.adopt(spec)
    on_vllm = tuple(dataclasses.replace(m, backend="vllm") for m in spec.models)
    with SweepRun(_args(), _clock()) as life:
        life.adopt(spec.__class__(**{**spec.__dict__, "reproducible": True, "models": on_vllm}))
    assert hosts == []
    with SweepRun(_args(), _clock()) as life:
        life.adopt(spec.__class__(**{**spec.__dict__, "reproducible": True}))  # builtin:tiny on the CPU engine here
    assert [h.backends for h in hosts] == [["auto"]] and hosts[0].stopped == 1
    hosts.clear()
    with SweepRun(_args(), _clock()) as life:
        life.adopt(spec)
        life.adopt(spec)  # decided once
    assert len(hosts) == 1 and hosts[0].stopped == 1


@pytest.mark.parametrize("here", [True, False], ids=["every node here", "a node elsewhere"])
def test_a_run_that_joins_a_cluster_starts_an_engine_host_once_joined_where_every_node_is_here(tmp_path, monkeypatch,
                                                                                               hosts, here):
    """`--address` (or RAY_ADDRESS): the host is decided once Ray is joined, from where the cluster's nodes run
    (cluster/launch.py cluster_on_this_machine); started then, and stopped with the rest at close. A reproducible
    spec on vLLM gets none either way."""
    import dataclasses
    from types import SimpleNamespace

    from cluster.inputs.spec_file import load_spec

    monkeypatch.setattr("cluster.schedule.run.prepare", lambda *a, **k: SimpleNamespace(
        sink=SimpleNamespace(close=lambda: None), nothing_left=False))
    monkeypatch.setattr("jobs.ray_start.check_ray_address", lambda *a: None)
    monkeypatch.setattr("jobs.ray_start.start_ray", lambda *a, **k: None)
    monkeypatch.setattr("jobs.local_ray.shutdown", lambda: None)
    monkeypatch.setattr("jobs.interrupts.reclaim", lambda: None)
    monkeypatch.setattr("cluster.launch.cluster_on_this_machine", lambda: here)
    monkeypatch.setattr("cluster.inputs.checks.check_inputs", lambda spec: SimpleNamespace(data=[], models={}))
    spec = load_spec(QUICKSTART / "quickstart.yaml")
    on_vllm = tuple(dataclasses.replace(m, backend="vllm") for m in spec.models)
    for reproducible in (False, True):
        with SweepRun(_args(address="127.0.0.1:6379"), _clock(), log=lambda line: None) as life:
            life.adopt(spec.__class__(**{**spec.__dict__, "reproducible": reproducible,
                                         **({"models": on_vllm} if reproducible else {})}))
            life.check()
            life.open(str(tmp_path / "out"))
            assert hosts == []  # not before Ray is joined
            life.start_ray()
            started = list(hosts)
        assert [h.backends for h in started] == ([["auto"]] if here and not reproducible else [])  # none on vLLM
        assert all(h.stopped == 1 for h in started)
        hosts.clear()


def test_a_temporary_folder_goes_at_close_and_one_a_killed_command_left_goes_with_the_next(tmp_path, monkeypatch):
    """`raysweep lm-eval`'s default output: removed at close; kill -9 skips the close, so the next command that makes
    one removes those of commands no longer running (a running one's stays)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    left, running = tmp_path / f"raysweep-lm-eval-output-{gone.pid}-abc", tmp_path / "raysweep-lm-eval-output-1-def"
    left.mkdir()
    running.mkdir()  # pid 1: init, always running
    with SweepRun(_args(), _clock()) as life:
        folder = life.temporary_folder("lm-eval-output")
        assert os.path.isdir(folder) and os.path.basename(folder).startswith(f"raysweep-lm-eval-output-{os.getpid()}-")
        assert not left.exists() and running.exists()
    assert not os.path.exists(folder) and running.exists()


@pytest.mark.slow
def test_a_run_reads_its_spec_checks_its_inputs_and_starts_ray_once(tmp_path):
    """The quickstart through `raysweep run`'s path, in a process of its own (its own local Ray): load_spec,
    check_inputs and Ray's start each called once."""
    from conftest import lean_quickstart

    spec = lean_quickstart(tmp_path)
    probe = textwrap.dedent(f"""
        import argparse, json, sys
        import cluster.inputs.checks as checks, cluster.inputs.spec_file as spec_file, jobs.ray_start as ray_start
        from cluster.contracts.timing import RunClock
        from jobs.sweep import run_spec

        calls = {{"load_spec": 0, "check_inputs": 0, "start_ray": 0}}
        for module, name in ((spec_file, "load_spec"), (checks, "check_inputs"), (ray_start, "start_ray")):
            def wrapper(*a, _original=getattr(module, name), _name=name, **k):
                calls[_name] += 1
                return _original(*a, **k)
            setattr(module, name, wrapper)
        args = argparse.Namespace(spec={str(spec)!r}, output={str(tmp_path / "out")!r},
                                  address=None, max_attempts=3, dashboard=False, new_run=True, verbose=False)
        code = run_spec(None, args, RunClock(0.0))
        print("CALLS", json.dumps(calls), code)
    """)
    env = {**os.environ, "RAYSWEEP_ENGINE_HOST": "0", "PYTHONPATH": str(QUICKSTART.parent)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CALLS ")), None)
    assert line is not None, done.stderr[-2000:]
    calls, code = line[6:].rsplit(" ", 1)
    assert json.loads(calls) == {"load_spec": 1, "check_inputs": 1, "start_ray": 1} and code == "0"
    assert (tmp_path / "out" / "summary.parquet").exists()


@pytest.mark.slow
def test_lm_eval_runs_its_request_types_through_one_sweep_run(tmp_path):
    """`raysweep lm-eval` over three request types (loglikelihood, generate_until, loglikelihood_rolling), in a
    process of its own: one SweepRun; the engine host decided and Ray started once; each request type's sweep
    checked, opened and executed through it; one close, which leaves no temporary folder."""
    pytest.importorskip("lm_eval")
    from tests.test_lm_eval_tasks import MAX_MODEL_LEN, _env, write_tasks

    tasks = write_tasks(tmp_path / "lm-eval-tasks")
    probe = textwrap.dedent(f"""
        import json
        import cluster.inputs.checks as checks, cluster.launch as launch, jobs.ray_start as ray_start
        from jobs.lifecycle import SweepRun
        from jobs.lm_eval_command import run

        calls = {{}}
        wrapped = [(launch, "start_engine_host"), (ray_start, "start_ray"), (checks, "check_inputs")] + [
            (SweepRun, name) for name in ("__init__", "adopt", "check", "open", "execute", "close")]
        for owner, name in wrapped:
            def wrapper(*a, _original=getattr(owner, name), _name=name, **k):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*a, **k)
            setattr(owner, name, wrapper)
        code = run(["--model", "raysweep", "--model_args",
                    "pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=1",
                    "--tasks", "rs_mc,rs_gen,rs_ppl", "--include_path", {str(tasks)!r}, "--limit", "2"])
        print("CALLS", json.dumps(calls, sort_keys=True), code)
    """)
    scratch = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's socket paths go under TMPDIR too
    env = {**_env(), "RAYSWEEP_ENGINE_HOST": "0", "TMPDIR": str(scratch), "PYTHONPATH": str(QUICKSTART.parent)}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600,
                              cwd=QUICKSTART.parent)
        left = [p.name for p in scratch.iterdir() if p.name.startswith("raysweep-")]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CALLS ")), None)
    assert line is not None, done.stderr[-3000:]
    calls, code = line[6:].rsplit(" ", 1)
    assert json.loads(calls) == {"__init__": 1, "start_engine_host": 1, "start_ray": 1, "adopt": 3, "check": 3,
                                 "check_inputs": 3, "open": 3, "execute": 3, "close": 1} and code == "0", calls
    assert done.stderr.count("engines kept from this process's last sweep") == 2  # the engines started once
    assert left == []


def test_a_stopped_runs_line_says_how_to_resume_and_a_stopped_verify_that_nothing_resumes():
    """`raysweep verify`'s sweep starts afresh every time, in a folder removed as the command ends or in its --keep
    folder: stopped, it says so, not that the same command resumes it."""
    from types import SimpleNamespace

    from jobs.interrupts import Interrupted, stopped_line

    sink = SimpleNamespace(manifest={"shards": {"a": {"state": "committed"}, "b": {"state": "pending"}}})
    stop = Interrupted(signal.SIGINT)
    assert stopped_line(stop, sink, "out").endswith("1 of 2 shard(s) committed in out; the same command resumes the rest")
    assert stopped_line(stop, sink, "out", complete=True).endswith(
        "all 1 shard(s) of the sweep committed in out; its summary is written as it stops")
    assert stopped_line(stop, SimpleNamespace(manifest={"shards": {}}), "out").endswith(
        "before any shard was planned; nothing was committed, and the same command starts the sweep")
    said = stopped_line(stop, sink, "/tmp/raysweep-verify-x/output", verifying=True, kept=False)
    assert said.endswith("the output it verifies is unchanged; run the command again")
    assert "/tmp/raysweep-verify-x" not in said
    kept = stopped_line(stop, sink, "mine", verifying=True, kept=True)
    assert kept.endswith("its sweep's rows so far stay in mine (run it again with another --keep folder)")
    assert "resumes" not in said + kept


def test_steps_go_in_order_and_close_releases_what_was_taken_once_the_last_first(tmp_path, monkeypatch, hosts):
    """Without Ray: the run's phases, a step out of order refused, and everything the run took (a temporary folder,
    the engine host, the sweep's sink, Ray and its reaper) released once, in the reverse of the order taken."""
    from types import SimpleNamespace

    from cluster.inputs.spec_file import load_spec
    from jobs.lifecycle import Phase

    released = []
    sink = SimpleNamespace(close=lambda: released.append("sink"))
    monkeypatch.setattr("cluster.schedule.run.prepare", lambda *a, **k: SimpleNamespace(sink=sink, nothing_left=False))
    monkeypatch.setattr("jobs.ray_start.start_ray", lambda *a, **k: None)
    monkeypatch.setattr("jobs.local_ray.reaper", lambda: SimpleNamespace(release=lambda: released.append("reaper")))
    monkeypatch.setattr("jobs.local_ray.shutdown", lambda: released.append("ray"))
    monkeypatch.setattr("jobs.interrupts.reclaim", lambda: None)
    spec = load_spec(QUICKSTART / "quickstart.yaml")
    life = SweepRun(_args(), _clock(), log=lambda line: None)
    assert life.phase is Phase.NEW
    folder = life.temporary_folder("phases")
    life.adopt(spec)
    with pytest.raises(RuntimeError, match="'opened' after 'read'"):
        life.open(str(tmp_path / "out"))
    life.check()
    life.open(str(tmp_path / "out"))
    life.start_ray()
    assert life.phase is Phase.RAY_UP and hosts[0].stopped == 0 and released == []
    hosts[0].stop = lambda: released.append("host")
    life.close()
    life.close()
    assert released == ["ray", "reaper", "sink", "host"] and not os.path.exists(folder)
    assert life.phase is Phase.CLOSED
    with pytest.raises(RuntimeError, match="after 'closed'"):
        life.adopt(spec)


def test_a_spec_with_lm_eval_entries_holds_lm_evals_request_cache_in_a_folder_of_its_own_until_close(tmp_path,
                                                                                                       monkeypatch,
                                                                                                       hosts):
    """lm-eval's request cache (which its building pass writes and its scoring pass reads) is in a folder of the run's
    own while the spec loads and the run lasts; at close lm-eval's own path is back and the folder gone. A spec
    without `lm_eval:` entries leaves lm-eval's path alone."""
    pytest.importorskip("lm_eval")
    import lm_eval.caching.cache as cache

    from cluster.inputs.spec_file import load_spec
    from cluster.lm_eval.adapter import request_cache_owned

    lm_evals_own, seen = cache.PATH, []
    monkeypatch.setattr(SweepRun, "begin", lambda self, *a, **k: None)  # no engine host, no Ray

    def loads(path):
        seen.append((cache.PATH, request_cache_owned()))
        return load_spec(QUICKSTART / "quickstart.yaml")

    monkeypatch.setattr("cluster.inputs.spec_file.load_spec", loads)
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"name": "s", "models": [{"name": "m", "path": "builtin:tiny"}],
                                "tasks": [{"lm_eval": {"tasks": ["arc_easy"]}}]}))
    life = SweepRun(_args(), _clock(), log=lambda line: None)
    life.read(str(spec))
    (folder, owned), = seen
    assert owned and folder != lm_evals_own and os.path.isdir(folder) and cache.PATH == folder
    life.close()
    assert cache.PATH == lm_evals_own and not request_cache_owned() and not os.path.exists(folder)

    spec.write_text(json.dumps({"name": "s", "models": [{"name": "m", "path": "builtin:tiny"}],
                                "tasks": [{"name": "t", "data": "x.jsonl", "prompt": "{q}"}]}))
    with SweepRun(_args(), _clock(), log=lambda line: None) as life:
        life.read(str(spec))
    assert seen[-1] == (lm_evals_own, False)
