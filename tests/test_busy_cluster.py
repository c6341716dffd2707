"""Joining a cluster as it is: a real `ray start --head` of one CPU, with token authentication.

- A command that sends no token is refused in one line that says how to send it (not 20 s of Ray's retries); one
  given the dashboard's port, or a port whose listener never answers, in one line (not a wait without end).
- A sweep whose actor cannot be placed, the CPU held by another job's actor, says so in one line (not "importing"
  for ever), and once the other work lets go it runs every row, once, and says the actor was placed."""

import os
import signal
import socket
import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import ROOT, lean_quickstart
from tests.test_cluster import TOKEN_AUTH, free_port, ray_head
from tests.test_reliability import wait_for

HOLDER = """
import ray, sys, time
ray.init(address=sys.argv[1])

@ray.remote(num_cpus=1)
class Holder:
    def ping(self):
        return 1

holder = Holder.remote()
ray.get(holder.ping.remote())
print("holding", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def head_and_dashboard():
    """(GCS address, dashboard host:port, Ray Client address) of one head."""
    client = free_port()
    with ray_head("--num-cpus=1", client_port=client) as (address, url):
        # the head starts its Ray Client server after its dashboard answers: a test that comes first waits for it
        assert wait_for(lambda: _listening(client), timeout_s=120), "no Ray Client server came up in 120 s"
        yield address, url.split("://", 1)[1], f"ray://127.0.0.1:{client}"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def head(head_and_dashboard):
    return head_and_dashboard[0]


@pytest.mark.slow
def test_a_command_that_sends_no_token_to_a_cluster_that_asks_for_one_is_told_how_in_one_line(tmp_path,
                                                                                                head_and_dashboard):
    """Its GCS address (a sweep, the pool) or its Ray Client address (the pool: Ray's client retried 30 s, then
    said "ray client connection timeout")."""
    head, _, client = head_and_dashboard
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    raysweep = [sys.executable, "-c", "import sys; from jobs.cli import entry; sys.argv[0] = 'raysweep'; entry()"]
    for address, command in ((head, [sys.executable, "-m", "jobs.sweep", str(lean_quickstart(tmp_path)), "--address",
                                     head, "--output", str(tmp_path / "out")]),
                             (head, [*raysweep, "pool", "status", "--address", head]),
                             (client, [*raysweep, "pool", "status", "--address", client])):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"raysweep: error: --address {address}: the Ray there asks for a token (token authentication), and this "
            "command sends none: `export RAY_AUTH_MODE=token`, with the cluster's token in ~/.ray/auth_token, the file "
            "RAY_AUTH_TOKEN_PATH names, or RAY_AUTH_TOKEN"), done.stderr
    assert not (tmp_path / "out").exists()  # refused before the output was touched


@pytest.mark.slow
def test_an_address_where_no_ray_gcs_answers_is_one_line_not_a_wait_without_end(tmp_path, head_and_dashboard):
    """The dashboard's port (a web server), or a port whose listener never answers: ray.init waited for ever, a
    warning line every 40 s."""
    _, dashboard, _ = head_and_dashboard
    with socket.socket() as silent:  # accepts connections, answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        quiet = f"127.0.0.1:{silent.getsockname()[1]}"
        for address, says in ((dashboard, "a web server answers there, not a Ray cluster's GCS (the Ray dashboard's "
                                          "port?)"),
                              (quiet, "something listens there, but no Ray GCS answered in 15 s")):
            done = subprocess.run([sys.executable, "-m", "jobs.sweep", str(lean_quickstart(tmp_path)), "--address",
                                   address, "--output", str(tmp_path / "out")], cwd=ROOT, env=os.environ | TOKEN_AUTH,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
                f"raysweep: error: --address {address}: {says}"), done.stderr[-2000:]


@pytest.mark.slow
def test_a_sweep_whose_actor_cannot_be_placed_says_so_and_runs_once_the_cpu_is_freed(tmp_path, head):
    spec = lean_quickstart(tmp_path, "busy")
    raw = yaml.safe_load(spec.read_text())
    raw["tasks"] = [t for t in raw["tasks"] if t["name"] == "extract"]  # one task: the wait is what is tested
    spec.write_text(yaml.safe_dump(raw))
    env, address = os.environ | TOKEN_AUTH, head
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, address], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        sweep = subprocess.Popen([sys.executable, "-m", "jobs.sweep", str(spec), "--address", address,
                                  "--output", str(tmp_path / "out")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(sweep.stdout), daemon=True)
        reader.start()
        try:
            said = wait_for(lambda: any("wait for Ray to place them" in line for line in lines), 180)
            assert said, "".join(lines[-20:])
            assert any("actor(s) waiting to be placed" in line for line in lines), "".join(lines[-20:])
            os.killpg(holder.pid, signal.SIGKILL)  # the other job ends: its actor's CPU is freed
            assert sweep.wait(timeout=300) == 0, "".join(lines[-30:])
        finally:
            if sweep.poll() is None:
                os.killpg(sweep.pid, signal.SIGKILL)
                sweep.wait()
        reader.join(timeout=10)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    text = "".join(lines)
    waited = next(line for line in lines if "wait for Ray to place them" in line)
    assert waited.startswith("[raysweep] 1 actor(s) wait for Ray to place them: each asks for CPU 1; the cluster has "
                             "CPU 0 of 1 free"), waited
    assert "1 actor(s) that waited were placed after" in text, text[-2000:]
    table = pq.read_table(tmp_path / "out" / "results")
    ids = table["sample_id"].to_pylist()
    rows = len((tmp_path / "busy-extract.jsonl").read_text().splitlines())
    assert len(ids) == len(set(ids)) == rows  # every row once
