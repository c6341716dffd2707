"""Where vLLM's engine core runs (actors/vllm_core_process.py), checked on CPU: the hook replaces the
process context of a stand-in for vLLM's engine-core launcher with a real forkserver, whose children write
through the output tee. Each case runs in its own interpreter: the tee takes over fds 1 and 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STAND_IN = r'''
import multiprocessing, os, sys, types
calls = []
launcher = types.ModuleType("vllm.v1.engine.utils")
def get_mp_context():  # vLLM's: checks, environment, then the method it forces inside Ray
    calls.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
    return multiprocessing.get_context("spawn")
launcher.get_mp_context = get_mp_context
for name in ("vllm", "vllm.v1", "vllm.v1.engine"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["vllm.v1.engine.utils"] = launcher
from actors import vllm_core_process as core
core.CORE_MODULE = "json"  # what the forkserver imports ahead
'''


def run_case(body: str, mode: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAYSWEEP_VLLM_CORE", "VLLM_LOGGING_LEVEL")}
    if mode is not None:
        env["RAYSWEEP_VLLM_CORE"] = mode
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", STAND_IN + body], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def test_forkserver_is_the_default_and_its_children_print_through_the_tee():
    done = run_case(r'''
assert core.start() == "forkserver"
assert os.environ["VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME"].startswith("VLLM_OBJECT_STORAGE_SHM_BUFFER_")
assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"  # the forkserver got INFO; this process keeps its own
assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
assert core.use_for_engine_core() == "forkserver"
assert core.use_for_engine_core() == "forkserver"  # a second engine start wraps nothing twice
ctx = launcher.get_mp_context()
assert calls == ["spawn"] and ctx.get_start_method() == "forkserver", (calls, ctx)
assert isinstance(ctx, core.EngineCoreContext)
tee = core.OutputTee.install()
mark = tee.mark()
p = ctx.Process(target=print, args=("engine core says hello",), kwargs={"flush": True})
p.start(); p.join(30)
assert p.exitcode == 0, p.exitcode
text = tee.text_since(mark)
assert "engine core says hello" in text, text
print("last words", file=sys.stderr)
tee.drain()
os._exit(0)  # as the engine thread leaves a broken engine: nothing printed before it is lost
''', None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine core says hello" in done.stderr and done.stderr.rstrip().endswith("last words")


def test_spawn_and_inprocess_leave_vllms_launcher_alone():
    done = run_case(r'''
assert core.start() == "spawn" and core.use_for_engine_core() == "spawned"
assert launcher.get_mp_context is get_mp_context
''', "spawn")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_case(r'''
assert core.start() == "inprocess" and core.use_for_engine_core() == "in-process"
assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and launcher.get_mp_context is get_mp_context
''', "inprocess")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_vllm_without_the_launcher_hook_gets_spawn():
    done = run_case(r'''
del launcher.get_mp_context
assert core.start() == "forkserver" and core.use_for_engine_core() == "spawned"
''', None)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_unknown_mode_is_one_clear_error():
    done = run_case("core.start()", "threads")
    assert done.returncode == 1
    assert "RAYSWEEP_VLLM_CORE='threads': use one of forkserver, fork, spawn, inprocess" in done.stderr


def test_an_engine_core_dies_with_its_forkserver():
    """The actor killed: its forkserver goes, and the engine core forked from it goes too (it would
    otherwise hold its GPU memory with no one to stop it)."""
    done = run_case(r'''
import signal, time
from multiprocessing import forkserver
core.start()
core.use_for_engine_core()
ctx = launcher.get_mp_context()
p = ctx.Process(target=time.sleep, args=(120,))
p.start()
os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
deadline = time.time() + 20
while time.time() < deadline:
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.1)
else:
    os.kill(p.pid, signal.SIGKILL)
    raise AssertionError("the engine core outlived its forkserver")
''', None)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_start_the_forkserver_does_not_fit_is_spawned_and_says_why():
    """vLLM sets some settings for its children as it builds a model's config: a forked core would miss
    them, so that start is spawned; so is one after the forkserver died."""
    done = run_case(r'''
import signal, time
from multiprocessing import forkserver
core.start(); core.use_for_engine_core()
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
assert launcher.get_mp_context().get_start_method() == "spawn" and core.used_mode() == "spawned"
del os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"]
assert launcher.get_mp_context().get_start_method() == "forkserver" and core.used_mode() == "forkserver"
os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
time.sleep(0.5)
assert launcher.get_mp_context().get_start_method() == "spawn" and core.used_mode() == "spawned"
''', None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine core spawned, not forked: VLLM_USE_BREAKABLE_CUDAGRAPH changed since the forkserver started" \
        in done.stderr
    assert "engine core spawned, not forked: the forkserver is not running" in done.stderr
