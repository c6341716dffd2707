"""How a failed vLLM engine start is read (actors/vllm_engine.py), on lines an H100 printed: a neighbour
freeing GPU memory during vLLM's profiling is retried, a graph or compile failure falls back to eager, and
anything else is the engine's own error, not hidden behind an eager start."""

from actors.vllm_engine import _GRAPH_FAILURE, _MEMORY_RACE, _error_lines, _failure_line, with_root_cause

START_REPORT = """\
(EngineCore pid=12917) INFO 11-22 09:14:14 [backends.py:1155] Dynamo bytecode transform time: 1.74 s
(EngineCore pid=12917) INFO 11-22 09:14:26 [monitor.py:53] torch.compile took 11.80 s in total
(EngineCore pid=12917) Capturing CUDA graphs (FULL):  26%|██▌       | 9/35 [00:00<00:00, 85.76it/s]
"""
MEMORY_RACE = START_REPORT + """\
(EngineCore pid=12917) ERROR 11-22 09:14:29 [core.py:1330] EngineCore failed to start.
(EngineCore pid=12917) ERROR 11-22 09:14:29 [core.py:1330] Traceback (most recent call last):
(EngineCore pid=12917) ERROR 11-22 09:14:29 [core.py:1330]   File "/var/tmp/site/vllm/v1/worker/gpu_worker.py", line 532, in determine_available_memory
(EngineCore pid=12917) ERROR 11-22 09:14:29 [core.py:1330]     assert self.init_snapshot.free_memory >= free_gpu_memory, (
(EngineCore pid=12917) ERROR 11-22 09:14:29 [core.py:1330] AssertionError: Error in memory profiling. Initial free memory 77.97 GiB, current free memory 78.36 GiB.
(EngineCore pid=12917) AssertionError: Error in memory profiling. Initial free memory 77.97 GiB, current free memory 78.36 GiB.
"""
GRAPH_FAILURE = START_REPORT + """\
(EngineCore pid=7) ERROR 11-22 09:14:29 [core.py:1330]   File "/var/tmp/site/vllm/v1/worker/gpu/model_runner.py", line 701, in capture_model
(EngineCore pid=7) ERROR 11-22 09:14:29 [core.py:1330] RuntimeError: CUDA error: operation not permitted when stream is capturing
"""
ENGINE_CORE_FAILED = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}")


def test_a_neighbour_freeing_memory_is_recognised_and_not_taken_for_a_graph_failure():
    assert _MEMORY_RACE.search(_error_lines(MEMORY_RACE))
    assert not _GRAPH_FAILURE.search(_error_lines(MEMORY_RACE))
    assert _failure_line(ENGINE_CORE_FAILED, MEMORY_RACE) == \
        "AssertionError: Error in memory profiling. Initial free memory 77.97 GiB, current free memory 78.36 GiB."


def test_a_neighbour_compiling_is_a_memory_race_too():
    log = START_REPORT + (
        "(EngineCore pid=4299) ERROR 11-22 09:23:05 [core.py:1330] ValueError: Free memory on device cuda:0 "
        "(18.17/79.18 GiB) on startup is less than desired GPU memory utilization (0.297, 23.52 GiB). Decrease GPU "
        "memory utilization or reduce GPU memory used by other processes.\n")
    assert _MEMORY_RACE.search(_error_lines(log)) and not _GRAPH_FAILURE.search(_error_lines(log))
    assert not _MEMORY_RACE.search(_error_lines(START_REPORT + "(EngineCore pid=1) INFO [gpu_worker.py:857] Free "
                                                "memory on device (78.66/79.18 GiB) on startup. Desired GPU\n"))


def test_a_capture_failure_is_a_graph_failure_and_its_line_names_the_cuda_error():
    assert _GRAPH_FAILURE.search(_error_lines(GRAPH_FAILURE))
    assert _failure_line(ENGINE_CORE_FAILED, GRAPH_FAILURE) == \
        "RuntimeError: CUDA error: operation not permitted when stream is capturing"


def test_a_healthy_start_report_names_dynamo_and_graphs_without_being_a_failure():
    assert _error_lines(START_REPORT) == ""
    assert _failure_line(ENGINE_CORE_FAILED, "") == \
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"


def test_a_failed_start_names_the_engine_cores_own_error_not_only_see_root_cause_above():
    """vLLM raises "See root cause above" in the actor; the root cause is in the engine core's log, which the
    driver never shows: the error the shards fail with names it (seen: a GPU test's 25 shards failed with only
    vLLM's line, its cause lost with the machine)."""
    error = with_root_cause(ENGINE_CORE_FAILED, START_REPORT + (
        "(EngineCore pid=4299) ERROR 11-22 09:23:05 [core.py:1330] ValueError: Free memory on device cuda:0 "
        "(18.17/79.18 GiB) on startup is less than desired GPU memory utilization (0.297, 23.52 GiB).\n"))
    assert isinstance(error, RuntimeError) and "\n" not in str(error)
    assert str(error).startswith("ValueError: Free memory on device cuda:0 (18.17/79.18 GiB) on startup")
    assert str(error).endswith("(vLLM: RuntimeError: Engine core initialization failed. See root cause above. "
                               "Failed core proc(s): {'EngineCore': 1})")
    assert with_root_cause(ENGINE_CORE_FAILED, START_REPORT) is ENGINE_CORE_FAILED  # nothing better: as it is


GIB = 1 << 30


def test_on_a_shared_gpu_the_kv_cache_is_sized_from_the_share_so_engines_can_start_together(tmp_path, monkeypatch):
    from actors.engine import EngineProfile
    from actors.vllm_args import engine_args, shared_kv_bytes
    from cluster.contracts.spec import ModelSpec

    monkeypatch.delenv("RAYSWEEP_SHARED_GPU_START", raising=False)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(2 * GIB)  # sparse: only its size is read
    model = ModelSpec("m", str(tmp_path))
    kv = shared_kv_bytes(model, str(tmp_path), 0.5, 80 * GIB)
    assert kv == int(0.9 * 0.5 * 80 * GIB - 1.2 * 2 * GIB - 3 * GIB)
    assert engine_args(model, str(tmp_path), EngineProfile(), 0.5, kv)["kv_cache_memory_bytes"] == kv
    assert shared_kv_bytes(model, str(tmp_path), 1.0, 80 * GIB) is None  # a whole GPU: vLLM measures
    assert shared_kv_bytes(model, str(tmp_path), 0.5, None) is None  # no NVML: vLLM measures
    assert shared_kv_bytes(model, str(tmp_path), 0.1, 40 * GIB) is None  # under 1 GiB left: vLLM measures
    spec_sized = ModelSpec("m", str(tmp_path), engine={"gpu_memory_utilization": 0.3})
    assert shared_kv_bytes(spec_sized, str(tmp_path), 0.5, 80 * GIB) is None  # the spec sizes memory itself
    monkeypatch.setenv("RAYSWEEP_SHARED_GPU_START", "serial")
    assert shared_kv_bytes(model, str(tmp_path), 0.5, 80 * GIB) is None
