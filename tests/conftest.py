"""Shared fixtures: the builtin model built into a temporary cache, and one local Ray with 2 CPUs."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "sweeps" / "quickstart.yaml"


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


@pytest.fixture(scope="session")
def tiny_path(model_cache) -> str:
    from cluster.builtin_model import resolve_model_path

    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="session")
def hf_engine(tiny_path):
    from actors.engine import EngineProfile
    from actors.hf_engine import HFEngine
    from cluster.spec import ModelSpec

    return HFEngine(ModelSpec("tiny", "builtin:tiny"), tiny_path, EngineProfile(), num_threads=1)


@pytest.fixture(scope="session")
def ray_local(model_cache):
    import ray

    # actors' output is noise in CPU runs; RAYSWEEP_TEST_RAY_LOGS=1 shows it (device runs)
    # address="local": always a fresh cluster, never one a `ray start` in another test left behind
    # metrics exported every second (Ray's default is 10 s), so a short sweep's gauges show while it runs
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             log_to_driver=bool(os.environ.get("RAYSWEEP_TEST_RAY_LOGS")),
             _system_config={"metrics_report_interval_ms": 1000})
    yield ray
    ray.shutdown()
