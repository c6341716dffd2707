"""A GPU actor's engine gets its share of the node's CPUs as threads (actors/engine_factory.py
engine_cpu_threads): Ray's default OMP_NUM_THREADS of the actor's num_cpus (1) made vLLM load builtin:large's
weights on one thread (14.2 s against 4.5 s with 16, on an H200). A value the user set is kept."""

import os

import pytest

from actors.engine_factory import engine_cpu_threads


@pytest.fixture
def sixteen_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize("set_by_ray", [True, False])
def test_a_gpu_actor_under_rays_default_gets_its_share_of_the_nodes_cpus(sixteen_cpus, monkeypatch, set_by_ray):
    if set_by_ray:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # Ray's default for num_cpus=1
    assert engine_cpu_threads(1, 0.5, 1) == 8 and os.environ["OMP_NUM_THREADS"] == "8"  # two engines on one GPU
    assert engine_cpu_threads(1, 1, 8) is None and os.environ["OMP_NUM_THREADS"] == "8"  # set once: kept


def test_shares_per_gpu_on_a_node_of_eight_gpus_and_an_unknown_count(sixteen_cpus):
    assert engine_cpu_threads(1, 1, 8) == 2
    os.environ.pop("OMP_NUM_THREADS")
    assert engine_cpu_threads(1, 1, None) == 16  # the node's GPUs unknown: the actor's GPU is taken as the node's


def test_a_value_the_user_set_a_cpu_actor_and_no_gain_change_nothing(sixteen_cpus, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # not Ray's default for num_cpus=1: the user's runtime_env
    assert engine_cpu_threads(1, 1, 1) is None and os.environ["OMP_NUM_THREADS"] == "4"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert engine_cpu_threads(2, 0, None) is None and "OMP_NUM_THREADS" not in os.environ  # the CPU engine sets its own
    assert engine_cpu_threads(16, 1, 1) is None  # Ray's default already gives it every CPU
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    assert engine_cpu_threads(16, 1, 1) is None and os.environ["OMP_NUM_THREADS"] == "16"
