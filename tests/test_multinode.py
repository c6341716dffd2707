"""A real two-node Ray cluster on one host: `ray start --head` and a second `ray start --address`, each with its
own ports and Ray folder, one CPU actor each. A sweep (`python -m jobs.sweep SPEC --address HEAD`, as a user runs
it) spreads over both nodes; a second sweep loses the second node mid-sweep (its raylet, agents and workers
killed) and still commits every sample exactly once, saying so in one line. The GPU variant gives each node two
GPUs (CUDA_VISIBLE_DEVICES 0,1 and 2,3, `--num-gpus 2`) and runs builtin:tiny on vLLM, two actors a node.

Each node is a `ray start --block` leading a session of its own (start_new_session), with a Ray folder of its
own (--temp-dir): the node's processes are that session's (its raylet and agents, and its workers, which lead
process groups of their own but stay in the session), so the test stops only what it started, never another
test's Ray or a user's (`ray stop` would stop them all)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from actors.engine_factory import cuda_and_vllm_available
from cluster.store.manifest import read_manifest
from tests.conftest import QUICKSTART, ROOT
from tests.test_cluster import TOKEN_AUTH, end_session, free_port, ray_head, session_processes

pytestmark = pytest.mark.slow

HANG_S = 300  # a sweep that has not ended by then hangs (the lean ones take well under a minute)
NODE_LOST = re.compile(r"^\[raysweep\] node \S+ \(\w+\) lost: .*shard\(s\).*$", re.M)


@dataclass
class Node:
    """A `ray start --address HEAD --block` of the test's: its process (its group's leader), its Ray folder, and
    the node id its raylet registered (from the raylet's command line)."""
    process: subprocess.Popen
    folder: str
    node_id: str = ""
    log: Path | None = None


def _node_processes(node: "Node") -> dict[int, str]:
    """{pid: args} of the node's processes (tests/test_cluster.py session_processes)."""
    return session_processes(node.process.pid, node.folder)


def start_node(gcs: str, *extra: str, env: dict | None = None) -> Node:
    """A second Ray node joined to the head at `gcs`, on this host, with ports of its own (workers on ports the
    system picks, not the 10002-19999 range every other Ray here uses) and its own Ray folder."""
    folder = tempfile.mkdtemp(prefix="rn-", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    log = Path(folder) / "ray-start.log"
    cmd = ["ray", "start", "--block", f"--address={gcs}", f"--temp-dir={folder}", "--min-worker-port=0",
           "--max-worker-port=0", f"--dashboard-agent-listen-port={free_port()}",
           f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
           "--disable-usage-stats", *extra]
    with open(log, "w") as f:  # os.environ passed on whole: NCCL_NVLS_ENABLE and the like stay as they are
        process = subprocess.Popen(cmd, env=os.environ | TOKEN_AUTH | (env or {}), stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    node = Node(process, folder, log=log)
    deadline = time.time() + 90
    while not node.node_id:
        raylet = [a for a in _node_processes(node).values() if "/raylet/raylet " in a]
        found = re.search(r"--node_id=(\w+)", raylet[0]) if raylet else None
        if found:
            node.node_id = found.group(1)
        elif process.poll() is not None or time.time() > deadline:
            stop_node(node)
            raise AssertionError(f"ray start --address {gcs} did not start a raylet: {log.read_text()[-3000:]}")
        else:
            time.sleep(0.3)
    return node


def stop_node(node: Node) -> None:
    """The node's processes killed at once, as a machine gone (tests/test_cluster.py end_session, which says why a
    SIGTERM first only waited). Its folder is removed only at the end (the test may still read its logs)."""
    end_session(node.process, node.folder)


PROBE = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.time() + 90
while not any(n["Alive"] and n["NodeID"] == sys.argv[2] for n in ray.nodes()):
    assert time.time() < deadline, ray.nodes()
    time.sleep(0.3)
print(next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]))
"""


@dataclass
class TwoNodes:
    gcs: str
    node_args: tuple
    node_env: dict | None
    head_id: str = ""
    node: Node | None = None
    gone: list = field(default_factory=list)  # nodes lost during a test, their folders removed at the end

    def add_node(self) -> None:
        """The second node, started and registered with the GCS (the probe waits for its node id)."""
        self.node = start_node(self.gcs, *self.node_args, env=self.node_env)
        probe = subprocess.run([sys.executable, "-c", PROBE, self.gcs, self.node.node_id], cwd=ROOT,
                               env=os.environ | TOKEN_AUTH, capture_output=True, text=True, timeout=150)
        assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-3000:]
        self.head_id = probe.stdout.strip().splitlines()[-1]

    def lose_node(self) -> None:
        """The second node's processes killed at once (SIGKILL: as a machine gone)."""
        stop_node(self.node)
        self.gone.append(self.node)
        assert not _node_processes(self.node), "a process of the lost node is still alive"


@contextmanager
def two_nodes(head: tuple = ("--num-cpus=1",), node: tuple = ("--num-cpus=1",), head_env: dict | None = None,
              node_env: dict | None = None):
    """A head (tests/test_cluster.py ray_head: free ports, its own folder) and a second node; yields once both
    are registered with the GCS, and stops both (only them) after."""
    with ray_head(*head, env=head_env) as (gcs, _):
        cluster = TwoNodes(gcs, node, node_env)
        try:
            cluster.add_node()
            yield cluster
        finally:
            if cluster.node is not None:
                stop_node(cluster.node)
            for gone in [cluster.node, *cluster.gone]:
                if gone is not None:
                    shutil.rmtree(gone.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def cpu_nodes():
    """One CPU each: one actor per node. Shared by the module's CPU tests (a node lost is started anew)."""
    with two_nodes() as cluster:
        yield cluster


@pytest.fixture
def cluster(cpu_nodes):
    if cpu_nodes.node in cpu_nodes.gone:
        cpu_nodes.add_node()
    return cpu_nodes


def small_spec(folder: Path, name: str, rows: int, shard: int, engine: dict | None = None,
               actors: dict | None = None) -> tuple[Path, int]:
    """The quickstart's arithmetic and choice tasks, their first `rows` rows (150 and 100 at most), in shards of `shard` samples, on
    builtin:tiny; one actor per node (1 CPU each). Returns the spec and its number of samples."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["name"] = name
    raw["models"] = [dict(raw["models"][0], engine=engine or {"max_num_seqs": 8})]
    raw["tasks"] = [t for t in raw["tasks"] if t["name"] in ("arithmetic", "choice")]
    # long outputs, no stop: a shard takes long enough that both engines are up while most shards still wait
    raw["tasks"][0]["sampling"] = {"max_tokens": 48, "temperature": 1.0, "seed": 3}
    total = 0
    for task in raw["tasks"]:
        data = folder / f"{name}-{task['name']}.jsonl"
        lines = (QUICKSTART.parent / task["data"]).read_text().splitlines(keepends=True)[:rows]
        data.write_text("".join(lines))
        task["data"], total = str(data), total + len(lines)
    raw["shards"] = {"max_samples": shard}
    raw["actors"] = actors or {"count": 2, "num_cpus": 1, "num_gpus": 0}
    spec = folder / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(raw))
    return spec, total


class Sweep:
    """`python -m jobs.sweep SPEC --address GCS` running, its output read as it comes (stdout and stderr)."""

    def __init__(self, spec: Path, out: Path, gcs: str, hang_s: float = HANG_S):
        self.out, self.lines, self.hang_s = out, [], hang_s
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out), "--address", gcs], cwd=ROOT,
            env=os.environ | TOKEN_AUTH | {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait(self) -> int:
        try:
            rc = self.process.wait(timeout=self.hang_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.reader.join(5)
            pytest.fail(f"the sweep did not end in {self.hang_s:.0f} s; it printed: {self.text[-5000:]}")
        self.reader.join(10)
        return rc

    def committed_on(self, node_id: str) -> dict[str, str]:
        """{shard id: actor id} of the shards committed so far that ran on `node_id`: their telemetry parts (on
        disk before each commit), with the manifest's word that they are committed."""
        try:
            shards = read_manifest(str(self.out))["shards"]
        except (FileNotFoundError, ValueError, OSError):
            return {}
        found = {}
        for part in (self.out / "telemetry" / ".pending").glob("shards-*.parquet"):
            try:
                rows = pq.read_table(part, columns=["shard_id", "actor_id", "node_id"]).to_pylist()
            except (OSError, ValueError):  # being written, or already folded in
                continue
            found |= {r["shard_id"]: r["actor_id"] for r in rows
                      if r["node_id"] == node_id and shards.get(r["shard_id"], {}).get("state") == "committed"}
        return found


def exactly_once(out: Path, total: int) -> None:
    results = pq.read_table(out / "results").to_pandas()
    keys = list(zip(results["task"].astype(str), results["sample_id"].astype(str)))
    assert len(keys) == len(set(keys)), "a sample appears twice"
    assert len(keys) == total, f"{len(keys)} of {total} samples in the results"
    shards = read_manifest(str(out))["shards"]
    assert {s["state"] for s in shards.values()} == {"committed"}, shards


def telemetry(out: Path, table: str):
    return pq.read_table(out / "telemetry" / f"{table}.parquet").to_pandas()


def test_a_sweep_spreads_over_two_nodes(cluster, tmp_path):
    """One actor per node, both with shards; both nodes on the driver's machine, so the command's engine host
    serves the actors of both (jobs/lifecycle.py `_host_for_cluster`). The fake engine holds every shard until both
    engines are up: with builtin:tiny's engine on a busy machine the head's actor had run every shard before the
    second node's actor was up."""
    hold = tmp_path / "hold"
    hold.touch()
    spec, total = small_spec(tmp_path, "two-nodes", rows=150, shard=5,
                             engine={"backend": "fake", "delay_s": 0.05, "hold_file": str(hold)})
    sweep = Sweep(spec, tmp_path / "out", cluster.gcs)
    deadline = time.time() + sweep.hang_s
    while sweep.text.count("[raysweep] engine up: ") < 2:
        assert sweep.process.poll() is None and time.time() < deadline, sweep.text[-4000:]
        time.sleep(0.1)
    hold.unlink()
    rc = sweep.wait()
    assert rc == 0, sweep.text[-5000:]
    exactly_once(tmp_path / "out", total)
    both = {cluster.head_id, cluster.node.node_id}
    actors = telemetry(tmp_path / "out", "actors")
    assert set(actors["node_id"]) == both, actors[["actor_id", "node_id"]]
    assert set(actors["engine_process"]) == {"host"}  # forked from the driver's host, the second node's actor too
    shards = telemetry(tmp_path / "out", "shards")
    assert set(shards["node_id"]) == both, shards[["shard_id", "actor_id", "node_id"]]
    assert " lost: " not in sweep.text and " died (" not in sweep.text, sweep.text[-3000:]
    print(sweep.text[-1500:])


def _lose_the_second_node(cluster: TwoNodes, sweep: Sweep, actors: int = 1, hold: Path | None = None) -> str:
    """Once shards that ran on the second node are committed, from `actors` of its actors (each of them ready:
    the driver knows where it runs), its processes are killed while the sweep still runs; the lost node's id.
    `hold` (the fake engine's hold file): made again before the kill, so every shard not begun waits and the node
    is lost with shards in flight however late this loop saw its commit on a busy machine (without it, the sweep
    once ended before the driver saw the node go, and said nothing of it); taken away once the loss is said."""
    deadline = time.time() + sweep.hang_s
    lost = cluster.node.node_id
    while len(set(sweep.committed_on(lost).values())) < actors:
        assert sweep.process.poll() is None, f"the sweep ended before the second node committed shards: {sweep.text[-4000:]}"
        assert time.time() < deadline, sweep.text[-4000:]
        time.sleep(0.1)
    if hold is not None:
        hold.touch()
    assert sweep.process.poll() is None, "the sweep ended before the node could be lost"
    cluster.lose_node()
    if hold is not None:
        while not NODE_LOST.search(sweep.text):
            assert sweep.process.poll() is None and time.time() < deadline, sweep.text[-4000:]
            time.sleep(0.1)
        hold.unlink()
    return lost


def _check_node_loss(sweep: Sweep, rc: int, out: Path, total: int, lost: str) -> None:
    text = sweep.text
    assert rc == 0, text[-5000:]
    exactly_once(out, total)
    said = NODE_LOST.findall(text)
    assert len(said) == 1, text[-5000:]
    assert f"({lost[:8]}) lost" in said[0], said
    assert " died (" not in text, text[-5000:]  # the node's actors are said in its line, not one by one
    shards = telemetry(out, "shards")
    assert lost in set(shards["node_id"]), shards[["shard_id", "node_id"]]
    print(said[0])


def test_losing_a_node_mid_sweep_loses_and_duplicates_nothing(cluster, tmp_path):
    """The second node's raylet and workers killed once it has committed a shard: the shards it held go to the
    head's actor, the sweep ends (exit 0) with every sample once, and one line says what happened. The fake
    engine (0.2 s a shard) holds every shard until both engines are up: however late the second node's actor
    starts, most of the work is still to do when it commits its first shard (with builtin:tiny's engine the
    head's actor had done it all by then, beside a second suite), and again from then until the loss is said."""
    hold = tmp_path / "hold"
    hold.touch()
    spec, total = small_spec(tmp_path, "node-lost", rows=150, shard=5,
                             engine={"backend": "fake", "delay_s": 0.2, "hold_file": str(hold)})
    sweep = Sweep(spec, tmp_path / "out", cluster.gcs)
    deadline = time.time() + sweep.hang_s
    while sweep.text.count("[raysweep] engine up: ") < 2:
        assert sweep.process.poll() is None and time.time() < deadline, sweep.text[-4000:]
        time.sleep(0.1)
    hold.unlink()
    lost = _lose_the_second_node(cluster, sweep, hold=hold)
    rc = sweep.wait()
    _check_node_loss(sweep, rc, tmp_path / "out", total, lost)


def _gpus() -> int:
    if not cuda_and_vllm_available():
        return 0
    import torch

    return torch.cuda.device_count()


def gpu_spec(folder: Path, rows: int, actors: int) -> tuple[Path, int]:
    """builtin:tiny on vLLM over `rows` short prompts, each answered with up to 256 tokens (a random model over a
    byte vocabulary seldom ends sooner), 4 requests at a time per engine, in shards of 4, 2 in flight per actor:
    enough work that every engine is up while most shards wait, however fast the GPUs; one GPU per actor."""
    data = folder / "gpu.jsonl"
    data.write_text("".join(f'{{"id": "g{i}", "text": "Count from {i}:"}}\n' for i in range(rows)))
    raw = {"name": "gpu-nodes", "models": [{"name": "tiny", "path": "builtin:tiny",
                                            "engine": {"backend": "vllm", "max_num_seqs": 4}}],
           "tasks": [{"name": "count", "data": str(data), "id_column": "id", "prompt": "{text}",
                      "sampling": {"max_tokens": 256, "temperature": 1.0, "seed": 5}}],
           "shards": {"max_samples": 4},
           "actors": {"count": actors, "num_cpus": 1, "num_gpus": 1, "shards_in_flight": 2}}
    spec = folder / "gpu-nodes.yaml"
    spec.write_text(yaml.safe_dump(raw))
    return spec, rows


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs or more and vLLM")
def test_gpu_nodes_losing_one_mid_sweep(tmp_path):
    """Two nodes of half the GPUs each (on 4 GPUs: CUDA_VISIBLE_DEVICES 0,1 and 2,3, `--num-gpus 2`); builtin:tiny
    on vLLM, one GPU per actor; the second node lost once all its actors committed shards: every sample once,
    exit 0, one line naming its actors."""
    half = _gpus() // 2
    head_gpus, node_gpus = [str(i) for i in range(half)], [str(i) for i in range(half, 2 * half)]
    spec, total = gpu_spec(tmp_path, rows=1200, actors=2 * half)
    # os.environ passed on whole to every process (NCCL_NVLS_ENABLE and the like stay as they are)
    with two_nodes(head=("--num-cpus=4", f"--num-gpus={half}"), node=("--num-cpus=4", f"--num-gpus={half}"),
                   head_env={"CUDA_VISIBLE_DEVICES": ",".join(head_gpus)},
                   node_env={"CUDA_VISIBLE_DEVICES": ",".join(node_gpus)}) as cluster:
        second = cluster.node.node_id
        sweep = Sweep(spec, tmp_path / "out", cluster.gcs, hang_s=900)  # the vLLM starts (compiles) first
        lost = _lose_the_second_node(cluster, sweep, actors=half)
        rc = sweep.wait()
    print(sweep.text[-6000:])
    actors = telemetry(tmp_path / "out", "actors")
    shown = actors[["actor_id", "node_id", "engine", "gpu_ids"]]
    assert set(actors["engine"]) == {"vllm"} and set(actors["node_id"]) == {cluster.head_id, second}, shown
    assert set(actors["engine_process"]) == {"host"}, actors["engine_process"]  # both nodes on the driver's machine
    # each node's actors on its own GPUs: Ray's GPU ids are those its node was started with
    assert set(actors[actors["node_id"] == second]["gpu_ids"]) == set(node_gpus), shown
    assert set(actors[actors["node_id"] == cluster.head_id]["gpu_ids"]) <= set(head_gpus), shown
    _check_node_loss(sweep, rc, tmp_path / "out", total, lost)
    said = NODE_LOST.findall(sweep.text)[0]
    assert re.search(r"actor\(s\) \d+" + r", \d+" * (half - 1) + r" (unreachable|gone)", said), said  # all its actors, one line
