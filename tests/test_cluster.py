"""Sweeps on a real Ray cluster: ray-cluster.yaml checked by Ray's own validation, `ray job submit`
against a real `ray start --head`, and autoscaling an L4 group from 0 to 2 nodes with Ray's
fake_multinode provider (the CPU engine standing in for vLLM)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import LEAN_EXTRACT_ROWS, QUICKSTART, ROOT, lean_quickstart

# `ray start` turns token authentication on; clients only read ~/.ray/auth_token in token mode
TOKEN_AUTH = {"RAY_AUTH_MODE": "token"}


def test_cluster_config_passes_rays_validation():
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    raw = yaml.safe_load((ROOT / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(raw))
    l4 = raw["available_node_types"]["l4"]
    assert l4["min_workers"] == 0 and l4["resources"]["accelerator_type:L4"] == 1 and l4["resources"]["GPU"] == 1
    assert any("raysweep[vllm]" in c for c in raw["setup_commands"]) and raw["idle_timeout_minutes"] > 0
    broken = dict(raw, idle_timeout_minutes="soon")
    with pytest.raises(Exception, match="soon"):
        validate_config(prepare_config(broken))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_head(*extra: str, env: dict | None = None, port: int | None = None, client_port: int | None = None):
    """`ray start --head --block` in its own process group and its own Ray folder; yields (gcs address, dashboard
    URL). Its own folder (--temp-dir): `ray start` records the head's address in `<folder>/ray_current_cluster`,
    and Ray's job supervisor gives a job's driver RAY_ADDRESS from that record ("auto"). In the shared /tmp/ray,
    a head started meanwhile by another test (another xdist worker's) or a user overwrote it, and a job submitted
    here was given that other cluster's address (seen: its driver failing for 6 minutes to reach "GCS at address
    ...:38397", the other worker's fake autoscaling cluster, stopped by then)."""
    for _ in range(3):  # started anew, on other free ports, where a head exits at once or its dashboard never
        # answers (seen once: no dashboard in 90 s, its cause not kept; a port taken between free_port and the bind
        # by another worker's Ray would do it)
        head, folder, address, url = _start_head(extra, env, port, client_port)
        if _dashboard_answers(head, url, within_s=90):
            break
        _end_head(head, folder)
    else:
        raise AssertionError("ray start --head did not come up three times (it exited, or its dashboard did not "
                             "answer in 90 s)")
    try:
        yield address, url
    finally:
        _end_head(head, folder)


def _dashboard_answers(head: subprocess.Popen, url: str, within_s: float) -> bool:
    """Whether the head's dashboard answers (a 401 without a token is an answer) while the head runs, within
    `within_s`."""
    deadline = time.time() + within_s
    while head.poll() is None and time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return True
        except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
            return True
        except OSError:
            time.sleep(0.5)
    return False


def _end_head(head: subprocess.Popen, folder: str) -> None:
    """Every process of the head killed (end_session), then its folder removed."""
    end_session(head, folder)
    shutil.rmtree(folder, ignore_errors=True)


def session_processes(leader: int, folder: str) -> dict[int, str]:
    """{pid: args} of a Ray node's processes: those of the session its `ray start` (`leader`) leads (its GCS, raylet
    and agents, and its workers, which lead process groups of their own but stay in the session), and any other
    naming its Ray folder. A zombie has ended: its parent has not reaped it yet."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,sid,stat,args"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines()[1:]:
        pid, sid, stat, args = (line.strip().split(None, 3) + [""])[:4]
        if (int(sid) == leader or folder in args) and int(pid) != os.getpid() and "Z" not in stat:
            found[int(pid)] = args
    return found


def end_session(leader: subprocess.Popen, folder: str) -> None:
    """SIGKILL to a `ray start --block` and every process of its node (session_processes), until none is left (a
    worker its raylet forked meanwhile; 30 s at most), then `leader` reaped. No SIGTERM first: on one, `ray start
    --block` never ends by itself (its children's SIGTERM exits are the expected ones, which it does not act on),
    and the GCS and raylet of a head or node that had run a test were all still up three seconds after it (the
    pool's, the two-node cluster's, measured on the 2-core machine): its grace only waited before the SIGKILL."""
    try:
        os.killpg(leader.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 30
    while (left := session_processes(leader.pid, folder)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    leader.wait()


def _start_head(extra, env, port, client_port=None):
    """One `ray start --head --block` with free ports (`port` for its GCS, `client_port` for its Ray Client server,
    where given) and a Ray folder of its own: (process, folder, gcs address, dashboard URL)."""
    port, dash = port or free_port(), free_port()
    folder = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    # every port a head binds by a fixed default is a free one: another Ray on the host (a user's, a test's) holds
    # 52365 or 10001 otherwise, and `ray job submit` then answers "No available agent" for minutes
    cmd = ["ray", "start", "--head", "--block", f"--port={port}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={free_port()}",
           f"--ray-client-server-port={client_port or free_port()}", "--disable-usage-stats", f"--temp-dir={folder}", *extra]
    head = subprocess.Popen(cmd, env=os.environ | TOKEN_AUTH | (env or {}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return head, folder, f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}"


@pytest.mark.slow
def test_ray_job_submit_runs_a_sweep_and_ray_job_stop_ends_it_in_one_line(tmp_path):
    """The README's job, with the spec's own relative output (no --output): the results must outlast the
    job's temporary copy of its working dir, and the run says where they are. The whole quickstart: a leaner one
    could be done before `ray job stop` lands, and the resume would then have nothing left to run."""
    out = tmp_path / "kept" / "results" / "quickstart"  # RAYSWEEP_RESULTS + the spec's `output`
    env_json = json.dumps({"env_vars": {"RAYSWEEP_RESULTS": str(tmp_path / "kept")}})
    with ray_head("--num-cpus=2") as (_, dashboard):
        stopped = _stopped_mid_shards(dashboard, {"working_dir": str(ROOT), **json.loads(env_json)})
        assert stopped.count("[raysweep] stopped by SIGTERM: ") == 1, stopped[-3000:]
        assert "; the same command resumes the rest" in stopped and "Traceback" not in stopped, stopped[-3000:]
        try:
            proc = subprocess.run(
                ["ray", "job", "submit", "--address", dashboard, "--working-dir", str(ROOT), "--runtime-env-json",
                 env_json, "--", "python", "-m", "jobs.sweep", "sweeps/quickstart.yaml"],
                env=os.environ | TOKEN_AUTH, capture_output=True, text=True, timeout=400)
        except subprocess.TimeoutExpired as e:  # what the job printed, not only that it did not end
            printed = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            pytest.fail(f"ray job submit did not end in 400 s; it printed: {printed[-4000:]}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "succeeded" in proc.stdout
        # the job's whole log, as `ray job logs` gives it: `ray job submit` follows the log over a websocket that
        # the job's end can close before its last lines came (seen: "succeeded" with the final lines missing)
        job_id = re.search(r"raysubmit_\w+", proc.stdout).group(0)
        logs = subprocess.run(["ray", "job", "logs", "--address", dashboard, job_id], env=os.environ | TOKEN_AUTH,
                              capture_output=True, text=True, timeout=120).stdout
    assert re.search(r"\[raysweep\] (\d+)/\1 samples \(100%\)", logs), logs[-3000:]  # progress in the job's logs
    assert "already committed)" in logs and " 0 already committed)" not in logs, logs[-3000:]  # it resumed
    assert f"the relative output results/quickstart goes to {out}" in logs, logs[-3000:]
    assert f"[raysweep] results: {out}" in logs, logs[-3000:]
    assert pq.read_table(out / "results").num_rows == JOB_SAMPLES


QUICKSTART_SAMPLES = 150 + 100 + LEAN_EXTRACT_ROWS  # a lean quickstart's, its extract task cut (tests/conftest.py)
JOB_SAMPLES = 150 + 100 + 100  # the whole quickstart's


STOP_MID_SHARDS = """
import json, re, sys, time
from ray.job_submission import JobStatus, JobSubmissionClient

dashboard, runtime_env, samples = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
client = JobSubmissionClient(dashboard)
deadline = time.time() + 300
while True:  # a head just started may have its dashboard up before its agent: "No available agent"
    try:
        job = client.submit_job(entrypoint="python -m jobs.sweep sweeps/quickstart.yaml", runtime_env=runtime_env)
        break
    except RuntimeError as e:
        assert "No available agent" in str(e) and time.time() < deadline, e
        time.sleep(1)
while not re.search(rf"\\[raysweep\\] [1-9]\\d*/{samples} samples \\(", client.get_job_logs(job)):
    assert time.time() < deadline and not client.get_job_status(job).is_terminal(), client.get_job_logs(job)[-3000:]
    time.sleep(0.3)
client.stop_job(job)
while not client.get_job_status(job).is_terminal():
    assert time.time() < deadline
    time.sleep(0.3)
# the stopped job's actors are gone, and their CPUs free for the next job (a next job that found them held waited
# for CPUs until its 400 s timeout, once in CI under load): a stopped job leaves nothing holding the cluster
from ray.util.state import list_actors
stopped_at = time.time()
while [a for a in list_actors(address=dashboard, filters=[("state", "!=", "DEAD")]) if a.class_name == "EvalActor"]:
    assert time.time() < deadline, ("the stopped job's actors still hold the cluster",
                                    list_actors(address=dashboard, filters=[("state", "!=", "DEAD")]))
    time.sleep(0.5)
print(f"the stopped job's actors were gone {time.time() - stopped_at:.1f}s after it stopped", file=sys.stderr)
time.sleep(1)  # the supervisor's last writes of the driver's output
print(client.get_job_status(job))
print(client.get_job_logs(job))
"""


def _stopped_mid_shards(dashboard: str, runtime_env: dict) -> str:
    """`ray job stop` (Ray's job supervisor sends the driver SIGTERM, then SIGKILL after 3 s) once the job's
    logs show samples done; the job's final status and logs (the same one line as any SIGTERM). In a
    process of its own, as the `ray job` CLI: this one may hold a Ray connection made without token auth."""
    done = subprocess.run([sys.executable, "-c", STOP_MID_SHARDS, dashboard, json.dumps(runtime_env),
                           str(JOB_SAMPLES)], cwd=ROOT,
                          env=os.environ | TOKEN_AUTH, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status, _, logs = done.stdout.partition("\n")
    assert status == "STOPPED", done.stdout[-3000:]
    return logs


FAKE_CLUSTER = {
    "cluster_name": "raysweep-fake-l4", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "l4": {"resources": {"CPU": 1, "GPU": 1, "accelerator_type:L4": 1}, "node_config": {},
               "min_workers": 0, "max_workers": 2},
    },
    "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
    "head_start_ray_commands": [], "worker_start_ray_commands": [],
    # what `ray up` would fill in; the fake provider skips that step, so the autoscaler needs them here
    "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
}


@pytest.mark.slow
def test_autoscaling_l4_group_from_zero_to_two(tmp_path):
    from ray._private.services import get_node_ip_address

    port = free_port()
    config = tmp_path / "fake-cluster.yaml"
    provider = dict(FAKE_CLUSTER["provider"], gcs_address=f"{get_node_ip_address()}:{port}")  # else :6379
    config.write_text(yaml.safe_dump(dict(FAKE_CLUSTER, provider=provider)))
    # 28 shards: work left for the second node's actor when it comes up
    spec = lean_quickstart(tmp_path, "l4", shards={"max_samples": 10})
    raw = yaml.safe_load(spec.read_text())
    raw["actors"] = {"count": 2, "num_gpus": 1, "num_cpus": 1, "accelerator_type": "L4"}
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    with ray_head(f"--autoscaling-config={config}", "--num-cpus=1", "--num-gpus=0",
                  env={"RAY_FAKE_CLUSTER": "1"}, port=port) as (gcs, _):
        proc = subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out)], cwd=ROOT,
                              env=os.environ | TOKEN_AUTH | {"RAY_ADDRESS": gcs}, capture_output=True, text=True,
                              timeout=300)
        # the sweep asked for two L4 actors up front: two L4 nodes come up, however soon the first one's actor
        # finished the work (on a loaded machine it may finish before the second node's actor starts)
        l4_nodes = _alive_nodes_with(gcs, "accelerator_type:L4", wanted=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # a hang: run's timeout, not a stopwatch
    results = pq.read_table(out / "results").to_pandas()
    keys = list(zip(results["task"].astype(str), results["sample_id"]))
    assert len(keys) == len(set(keys)) == QUICKSTART_SAMPLES
    assert l4_nodes == 2
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    assert len(actors) >= 1 and set(actors["engine"]) == {"hf"}  # no CUDA on the fake nodes: the CPU engine ran


def _alive_nodes_with(gcs: str, resource: str, wanted: int, timeout_s: float = 180) -> int:
    """How many alive nodes of the cluster at `gcs` hold `resource`, once `wanted` do or `timeout_s` passed."""
    code = (f"import ray, time\nray.init(address={gcs!r}, logging_level='ERROR')\nend = time.time() + {timeout_s}\n"
            "while True:\n"
            f"    n = sum(1 for x in ray.nodes() if x['Alive'] and x['Resources'].get({resource!r}))\n"
            f"    if n >= {wanted} or time.time() > end:\n        break\n    time.sleep(1)\nprint(n)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=os.environ | TOKEN_AUTH, capture_output=True,
                          text=True, timeout=timeout_s + 120)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


def test_the_autoscalers_node_types_are_read_from_this_clusters_monitor_not_another_heads(tmp_path):
    """Two Ray heads on one machine (two users, or two test suites): each autoscaler's monitor process names
    its config; the node types are those of the monitor whose --gcs-address is this cluster's (by its port).
    Before, the first monitor found was read: a sweep beside another head saw no 4-GPU node type."""
    from cluster.plan.placement import read_node_types

    monitors = []
    try:
        for port, gpus in (("40111", 1), ("40222", 4)):
            config = tmp_path / f"{port}.yaml"
            config.write_text(yaml.safe_dump({"available_node_types": {
                "head": {"resources": {"CPU": 1}, "max_workers": 0},
                "gpu": {"resources": {"CPU": 1, "GPU": gpus}, "max_workers": 1}}}))
            monitors.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "monitor.py",
                                              f"--gcs-address=10.0.0.1:{port}", f"--autoscaling-config={config}"]))
        for monitor in monitors:  # Popen returns once the exec began; /proc shows the new argv a moment later
            _wait_for_cmdline(monitor.pid, "monitor.py")
        assert read_node_types("40222") == [{"CPU": 1, "GPU": 4}]
        assert read_node_types("40111") == [{"CPU": 1, "GPU": 1}]
    finally:
        for monitor in monitors:
            monitor.kill()
            monitor.wait()


def _wait_for_cmdline(pid: int, word: str, limit_s: float = 60.0) -> None:
    """Until /proc/PID/cmdline holds `word` (a bound only a hang reaches)."""
    end = time.monotonic() + limit_s
    while word.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < end, f"process {pid} never showed {word!r} in its cmdline"
        time.sleep(0.01)


@pytest.mark.slow
def test_autoscaling_starts_a_four_gpu_node_for_a_tensor_parallel_4_model(tmp_path):
    """A model of tensor_parallel_size 4 on an autoscaled cluster at zero workers, with node types of 1 L4
    and of 4 L4s: the driver asks for a 4-GPU bundle, the autoscaler starts a 4-GPU node (no 1-GPU node can
    hold it), and the actor holds that node's 4 GPUs."""
    from ray._private.services import get_node_ip_address

    port = free_port()
    config = tmp_path / "fake-cluster.yaml"
    provider = dict(FAKE_CLUSTER["provider"], gcs_address=f"{get_node_ip_address()}:{port}")
    types = dict(FAKE_CLUSTER["available_node_types"],
                 l4x4={"resources": {"CPU": 1, "GPU": 4, "accelerator_type:L4": 1}, "node_config": {},
                       "min_workers": 0, "max_workers": 1})
    config.write_text(yaml.safe_dump(dict(FAKE_CLUSTER, provider=provider, available_node_types=types)))
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["models"] = [dict(raw["models"][0], engine={"tensor_parallel_size": 4})]
    raw["tasks"] = raw["tasks"][:1]
    raw["actors"] = {"count": 1, "num_cpus": 1, "accelerator_type": "L4"}
    for task in raw["tasks"]:
        task["data"] = str(QUICKSTART.parent / task["data"])
    spec = tmp_path / "tp4.yaml"
    spec.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    with ray_head(f"--autoscaling-config={config}", "--num-cpus=1", "--num-gpus=0",
                  env={"RAY_FAKE_CLUSTER": "1"}, port=port) as (gcs, _):
        proc = subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out)], cwd=ROOT,
                              env=os.environ | TOKEN_AUTH | {"RAY_ADDRESS": gcs}, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    assert len(actors) == 1 and actors["gpus"].tolist() == [4], actors[["actor_id", "node_id", "gpus"]]
    results = pq.read_table(out / "results").to_pandas()
    assert len(results) == len(set(results["sample_id"]))
