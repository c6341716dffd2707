"""jobs/ray_patience.py: a local Ray's start waits for its node past Ray's own 30 s, up to the bound the user sets,
and says what it waits for every 10 s. On a 2-core machine at a load of 15-21, Ray's 30 s ran out again and again
("The current node timed out during startup")."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import jobs.ray_patience as patience
from tests.conftest import ROOT


def test_the_call_it_wraps_is_the_one_rays_node_start_waits_on():
    """Ray 2.60's Node waits for its node by calling ray._private.services.get_node through the module (so the
    wrapper is what it calls) under a fixed 30 s; if Ray moves this, the patience does nothing: this fails."""
    from ray._private import node

    source = inspect.getsource(node.Node.__init__)
    assert "ray._private.services.get_node(" in source and "raylet_start_wait_time_s = 30" in source


def test_a_node_that_registers_late_is_waited_for_and_the_wait_is_said(monkeypatch):
    import ray._private.services as services

    calls, said = [], []

    def late(*args, **kwargs):
        calls.append(args)
        if len(calls) < 4:
            raise RuntimeError("node not found")
        return {"node": args}

    monkeypatch.setattr(services, "get_node", late)
    monkeypatch.setattr(patience, "ASK_EVERY_S", 0.05)
    monkeypatch.setattr(patience, "SAY_EVERY_S", 0.05)
    with patience.patient_start(30.0, say=said.append):
        assert services.get_node("gcs", "id") == {"node": ("gcs", "id")}
        import time
        time.sleep(0.2)
    assert len(calls) == 4 and services.get_node is late  # put back
    assert said and "still starting a local Ray" in said[-1] and "register with its GCS" in said[-1]
    assert "RAYSWEEP_RAY_START_TIMEOUT_S" in said[-1]


def test_past_the_bound_the_wait_ends(monkeypatch):
    import ray._private.services as services

    def never(*args, **kwargs):
        raise RuntimeError("node not found")

    monkeypatch.setattr(services, "get_node", never)
    monkeypatch.setattr(patience, "ASK_EVERY_S", 0.01)
    with patience.patient_start(0.1, say=lambda line: None), pytest.raises(RuntimeError, match="node not found"):
        services.get_node("gcs", "id")


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "inf", "nan"])
def test_a_bound_that_is_not_a_number_of_seconds_is_refused(monkeypatch, raw):
    monkeypatch.setenv(patience.ENV, raw)
    with pytest.raises(ValueError, match=f"{patience.ENV}="):
        patience.start_bound_s()


@pytest.mark.slow
def test_a_real_local_ray_whose_node_registers_after_rays_30_s_starts(tmp_path):
    """A real `start_ray("local")` (what `raysweep run` calls) in a process of its own, its node's registration
    seen late, as on a machine too busy for the raylet: get_node fails until Ray's node module's clock says 32 s
    since it was first asked (not since the script's start: under load Ray's processes started later than that).
    That clock runs ten times fast here (only `ray._private.node`'s `time`, only during the start), so Ray's own
    loop had given up at its 30 s after 3 s; the command's start waits past it, says so, and Ray is up."""
    script = textwrap.dedent("""
        import time, types
        import ray, ray._private.node as node, ray._private.services as services
        fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
        origin = time.monotonic()
        fast.monotonic = lambda: origin + 10 * (time.monotonic() - origin)
        real, asked = services.get_node, []
        def late(*args, **kwargs):  # 32 s from the first ask: on a busy machine Ray's processes start late
            asked.append(fast.monotonic())
            if fast.monotonic() - asked[0] < 32:
                raise RuntimeError("node not registered yet")
            return real(*args, **kwargs)
        services.get_node, node.time = late, fast
        import jobs.ray_patience as patience
        patience.SAY_EVERY_S = 1.0
        from jobs import local_ray
        from jobs.ray_start import start_ray
        try:
            start_ray("local", "local", dashboard=False)
            node.time = time
            print("UP", ray.is_initialized(), flush=True)
        finally:
            node.time = time
            ray.shutdown()
            local_ray.shutdown()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "UP True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "still starting a local Ray" in proc.stdout and "register with its GCS" in proc.stdout, proc.stdout
