"""Shared fixtures: the builtin model built into a temporary cache, and one local Ray with 2 CPUs."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# lm-eval's own command line, its task index built from --include_path alone (the parity tests' references)
LM_EVAL = [sys.executable, str(ROOT / "tests" / "lm_eval_reference.py")]
QUICKSTART = ROOT / "sweeps" / "quickstart.yaml"
LEAN_EXTRACT_ROWS = 30  # of the quickstart's 100 `extract` rows: their 96-token JSON outputs took 19 of a run's 28
# engine-seconds on the 2-core CPU machine, and tests of interrupts and resumes need shards, not long ones


def first_rows(data: Path, rows: int, dest: Path) -> Path:
    """`data`'s first `rows` lines (a JSONL file's first rows), written to `dest`."""
    dest.write_text("".join(data.read_text().splitlines(keepends=True)[:rows]))
    return dest


def lean_quickstart(folder: Path, name: str = "quickstart", shards: dict | None = None, **task_changes) -> Path:
    """The quickstart with LEAN_EXTRACT_ROWS of extract's rows (a file of its own in `folder`), written to
    `folder/NAME.yaml` with its data paths absolute; `shards` replaces its shard limits, `task_changes` go into
    every task."""
    import yaml

    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["name"] = name
    if shards is not None:
        raw["shards"] = shards
    for task in raw["tasks"]:
        data = QUICKSTART.parent / task["data"]
        if task["name"] == "extract":
            data = first_rows(data, LEAN_EXTRACT_ROWS, folder / f"{name}-extract.jsonl")
        task["data"] = str(data)
        task.update(task_changes)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
_EXIT_STATUS = []  # pytest's own exit status, kept for pytest_unconfigure


# Files whose tests run programs in the code_exec sandbox, as the user nobody: they share that user's process
# limit (a fork bomb's test fills it) and its process table (tests count nobody's processes), so under
# pytest-xdist they go to one worker, one after another. Every other file is a group of its own: its module
# fixtures (a sweep run once for several tests) are made once, on one worker.
SANDBOX_FILES = {"test_sandbox.py", "test_code_exec_reference.py", "test_scoring_kinds.py", "test_signals.py",
                 "test_hostile_inputs.py", "test_report.py"}


def prepare_file(path, **options):
    """`prepare` for a spec file, its inputs checked first, as a command's sweep does (jobs/lifecycle.py)."""
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.spec_file import load_spec
    from cluster.schedule.run import prepare

    spec = load_spec(path)
    return prepare(spec, check_inputs(spec).data, **options)


# The groups that take longest on the 2-core machine, longest first (pytest --durations): handed out first, so
# the two workers end together rather than one running a long group alone at the end (`pytest_configure` turns
# xdist's own order, by number of tests, off). The other files follow in their collection order.
LONGEST_FIRST = ("sandbox", "test_pool.py", "test_reliability.py", "test_lm_eval_tasks.py", "test_cluster.py",
                 "test_parallel.py", "test_lm_eval_settings.py", "test_engine_start_failures.py", "test_sweep.py",
                 "test_reproducible.py", "test_disk_full.py", "test_lm_eval_command.py", "test_multinode.py",
                 "test_lm_eval_hf_parity.py", "test_lifecycle.py", "test_whole_sweep.py", "test_silence.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's; a machine without xdist has no such option
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which names each test by the group it finds marked
def pytest_collection_modifyitems(config, items):
    """The xdist group of each test (`--dist loadgroup`, pyproject.toml): its file's, or the sandbox's; the
    groups of LONGEST_FIRST first, in its order."""
    rank = {group: k for k, group in enumerate(LONGEST_FIRST)}
    order = {}
    for index, item in enumerate(items):
        name = item.path.name
        group = "sandbox" if name in SANDBOX_FILES else name
        item.add_marker(pytest.mark.xdist_group(group))
        order[item.nodeid] = (rank.get(group, len(rank)), index)
    items.sort(key=lambda item: order[item.nodeid])


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's exit status, without the interpreter's finalization: after "422 passed, 14
    skipped" the suite's process once died of SIGSEGV in libstdc++ while exiting (2026-11-24, this 2-core
    machine), with threads of the C++ libraries it loaded (Ray's core worker, Arrow, DuckDB, torch) still
    running as static destructors ran. Every result is printed by then, and the status is pytest's."""
    import sys

    if hasattr(config, "workerinput"):  # an xdist worker: it leaves as xdist ends it, its results already sent
        return
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """Point the builtin-model cache at a temp dir (set before Ray starts, so its workers inherit it)."""
    cache = tmp_path_factory.mktemp("raysweep-cache")
    old = os.environ.get("RAYSWEEP_CACHE")
    os.environ["RAYSWEEP_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("RAYSWEEP_CACHE", None)
    else:
        os.environ["RAYSWEEP_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def ray_auth_token(tmp_path_factory):
    """A Ray token of the suite's own for every cluster it starts and every client it runs: `ray start` in
    token mode refuses to start without one, and a fresh machine has no ~/.ray/auth_token until some local
    `ray.init` writes it (a test of `ray start` run alone or first failed at once on such a machine)."""
    import secrets

    token = tmp_path_factory.mktemp("ray-auth") / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    old = os.environ.get("RAY_AUTH_TOKEN_PATH")
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)  # read by Ray's token loader, here and in every child process
    yield token
    if old is None:
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    else:
        os.environ["RAY_AUTH_TOKEN_PATH"] = old


@pytest.fixture(scope="session")
def tiny_path(model_cache) -> str:
    from cluster.inputs.builtin_model import resolve_model_path

    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="session")
def hf_engine(tiny_path):
    from actors.engine import EngineProfile
    from actors.hf_engine import HFEngine
    from cluster.contracts.spec import ModelSpec

    return HFEngine(ModelSpec("tiny", "builtin:tiny"), tiny_path, EngineProfile(), num_threads=1)


def gpu_count() -> int:
    """The CUDA GPUs this process sees where vLLM is installed (GPU tests), else 0."""
    from actors.engine_factory import cuda_and_vllm_available

    if not cuda_and_vllm_available():
        return 0
    import torch

    return torch.cuda.device_count()


def start_local_ray():
    import ray

    # actors' output is noise in CPU runs; RAYSWEEP_TEST_RAY_LOGS=1 shows it (device runs)
    # address="local": always a fresh cluster, never one a `ray start` in another test left behind
    # metrics exported every second (Ray's default is 10 s), so a short sweep's gauges show while it runs
    # no idle workers started ahead for the driver: this Ray lives the whole session, and on the 2-core machine an
    # idle one took 4.1 CPU-s a minute with them, 2.9 without (two idle Python workers polling)
    from jobs.ray_patience import patient_start, start_bound_s

    with patient_start(start_bound_s()):  # as a command's local Ray waits on a busy machine, not Ray's 30 s
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 log_to_driver=bool(os.environ.get("RAYSWEEP_TEST_RAY_LOGS")),
                 _system_config={"metrics_report_interval_ms": 1000, "prestart_worker_first_driver": False})
    return ray


@pytest.fixture(scope="session")
def engine_host(model_cache):
    """An engine host (cluster/launch.py EngineHost) for the session's sweeps run in this process: their actors
    get engine processes forked from it, as a local command's do from its own, rather than each importing torch
    and transformers itself (6-8 CPU-s an actor on the 2-core machine). Started once, for the tests that ask."""
    from cluster.launch import EngineHost

    host = EngineHost(["hf", "fake"])
    yield host.address
    host.stop()


_SESSION_RAY_STOPPED = []  # non-empty while a fake_cluster test has stopped the session's local Ray (ray_local)


@pytest.fixture(scope="session")
def ray_local(model_cache):
    from jobs import local_ray

    ray = start_local_ray()
    yield ray
    local_ray.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The session's local Ray, stopped by a fake_cluster test, started again before the next test that uses it
    (ray_local among its fixtures, directly or through a module's): not after every fake_cluster test, as two of
    them in a row (tests/test_parallel.py) each paid a start of it that nothing used."""
    if _SESSION_RAY_STOPPED and "ray_local" in item.fixturenames:
        import ray

        if not ray.is_initialized():
            start_local_ray()
        _SESSION_RAY_STOPPED.clear()


@pytest.fixture
def fake_cluster(model_cache):
    """`ray.cluster_utils.Cluster` for one test: `make(nodes)` starts a head without GPUs and one node per
    {num_cpus, num_gpus} and connects this process to it. The session's local Ray (ray_local), if it was
    up, is started again before the next test that uses it (pytest_runtest_setup)."""
    import ray
    from ray.cluster_utils import Cluster

    was_up = ray.is_initialized()
    ray.shutdown()
    made = []

    def make(nodes: list[dict]):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
        made.append(cluster)
        added = [cluster.add_node(**node) for node in nodes]
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        return added

    yield make
    ray.shutdown()
    for cluster in made:
        cluster.shutdown()
    if was_up:
        _SESSION_RAY_STOPPED.append(True)


def replay_spec(folder: Path, name: str, rows: list[dict], scorer: str = "exact_match", extra: str = "",
                shards: str = "", data: str = "d.jsonl") -> Path:
    """A spec of one replay task (completions from the rows' `out` column, no engine) over `rows` (written as
    `data` unless it is there already: a Parquet file the test wrote), prompt {q}, target a; its output is
    folder/out. `extra`: more of the task's fields; `shards`: the spec's shards mapping."""
    import json

    if data.endswith(".jsonl"):
        (folder / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = folder / "s.yaml"
    spec.write_text(f"name: {name}\noutput: {folder / 'out'}\nmodels: []\ntasks:\n"
                    f"  - {{name: t, data: {data}, id_column: id, prompt: \"{{q}}\", target: a, scorer: {scorer},"
                    f" replay: {{column: out, model: api-model}}{', ' + extra if extra else ''}}}\n"
                    + (f"shards: {shards}\n" if shards else ""))
    return spec
