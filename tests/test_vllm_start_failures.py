"""How a vLLM engine start is read, on lines vLLM printed on H100s and H200s: a failed one (actors/vllm_start_errors.py)
— a neighbour freeing GPU memory during vLLM's profiling is retried, a graph or compile failure falls back to eager,
and anything else is the engine's own error, not hidden behind an eager start — and a healthy one's steps
(actors/vllm_engine.py `start_report`)."""

import os
from pathlib import Path

import pytest

from actors.vllm_start_errors import GRAPH_FAILURE as _GRAPH_FAILURE, MEMORY_RACE as _MEMORY_RACE, \
    error_lines as _error_lines, failure_line as _failure_line, with_root_cause

ROOT = Path(__file__).resolve().parents[1]
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


# one engine core's start-up report on an H200 (bench/records/4xh200-8b-two-engines-and-loglikelihood.txt), every
# cache empty, on the code from before FlashInfer's sampler was turned off: the 102 s between the capture and the end
# of "init engine" are the span in which the fresh-node record (bench/records/h200-suite-8b-fresh-node.md) found
# FlashInfer building its sampler; with the capture's progress lines as vLLM 0.26 writes them (that record keeps none)
COMPILED_START = """\
(EngineCore pid=8448) INFO 11-28 22:02:50 [default_loader.py:430] Loading weights took 4.64 seconds
(EngineCore pid=8448) INFO 11-28 22:02:51 [model_runner.py:305] Model loading took 13.25 GiB and 7.888397 seconds
(EngineCore pid=8448) INFO 11-28 22:03:07 [backends.py:393] Compiling a graph for compile range (1, 16384) takes 8.28 s
(EngineCore pid=8448) INFO 11-28 22:03:12 [monitor.py:53] torch.compile took 20.97 s in total
(EngineCore pid=8448) INFO 11-28 22:03:13 [monitor.py:81] Initial profiling/warmup run took 0.41 s
(EngineCore pid=8448) INFO 11-28 22:03:14 [gpu_worker.py:560] Available KV cache memory: 110.57 GiB
(EngineCore pid=8448) Capturing CUDA graphs (PIECEWISE):   0%|          | 0/51 [00:00<?, ?it/s]
(EngineCore pid=8448) Capturing CUDA graphs (FULL):   0%|          | 0/51 [00:00<?, ?it/s]
(EngineCore pid=8448) INFO 11-28 22:03:19 [model_runner.py:747] Graph capturing finished in 5 secs, took 0.99 GiB
(EngineCore pid=8448) INFO 11-28 22:05:01 [core.py:340] init engine (profile, create kv cache, warmup model) took 130.29 s (compilation: 20.97 s)
"""


def test_a_healthy_start_report_gives_each_steps_seconds_and_the_graph_mode():
    from actors.vllm_engine import start_report

    assert start_report(COMPILED_START) == {
        "weights_s": 7.888397, "core_init_s": 130.29, "compile_s": 20.97, "profile_run_s": 0.41,
        "graph_capture_s": 5.0, "graph_mode": "FULL_AND_PIECEWISE"}
    # made-up lines of vLLM's forms: the other model runner's wording of the weights' line, and an uncompiled
    # engine, which names no torch.compile
    uncompiled = ("(EngineCore pid=7) INFO 11-22 09:14:10 [gpu_model_runner.py:5347] Model loading took 0.48 GiB memory "
                  "and 1.250000 seconds\n(EngineCore pid=7) Capturing CUDA graphs (FULL):   0%|\n"
                  "(EngineCore pid=7) INFO 11-22 09:14:20 [core.py:340] init engine (profile, create kv cache, warmup "
                  "model) took 9.50 s\n")
    assert start_report(uncompiled) == {"weights_s": 1.25, "core_init_s": 9.5, "compile_s": None,
                                        "profile_run_s": None, "graph_capture_s": None, "graph_mode": "FULL"}
    assert start_report("") == {"weights_s": None, "core_init_s": None, "compile_s": None, "profile_run_s": None,
                                "graph_capture_s": None, "graph_mode": "NONE"}


def test_a_start_report_not_read_takes_the_graph_mode_vllm_resolved():
    """Where the core's INFO lines were not read, the started engine's resolved cudagraph_mode names its graphs, as
    the report would: FULL_DECODE_ONLY captures full graphs alone."""
    import enum
    from types import SimpleNamespace

    from actors.vllm_engine import configured_graph_mode

    Mode = enum.Enum("CUDAGraphMode", {"NONE": 0, "PIECEWISE": 1, "FULL": 2, "FULL_DECODE_ONLY": (2, 0),
                                       "FULL_AND_PIECEWISE": (2, 1)})  # vLLM's, as config/compilation.py has it
    named = {mode.name: configured_graph_mode(SimpleNamespace(cudagraph_mode=mode)) for mode in Mode}
    assert named == {"NONE": "NONE", "PIECEWISE": "PIECEWISE", "FULL": "FULL", "FULL_DECODE_ONLY": "FULL",
                     "FULL_AND_PIECEWISE": "FULL_AND_PIECEWISE"}


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
    spec_share = ModelSpec("m", str(tmp_path), engine={"gpu_memory_utilization": 0.3})
    assert shared_kv_bytes(spec_share, str(tmp_path), 0.5, 80 * GIB) == int(0.3 * 80 * GIB - 1.2 * 2 * GIB - 3 * GIB)
    spec_sized = ModelSpec("m", str(tmp_path), engine={"kv_cache_memory_bytes": 4 * GIB})
    assert shared_kv_bytes(spec_sized, str(tmp_path), 0.5, 80 * GIB) is None  # the spec sizes the cache itself
    monkeypatch.setenv("RAYSWEEP_SHARED_GPU_START", "serial")
    assert shared_kv_bytes(model, str(tmp_path), 0.5, 80 * GIB) is None


# lines a plain `LLM(..., tensor_parallel_size=2)` script logged on a 4xH200 machine with NVLink multicast off
# and vLLM's FlashInfer all-reduce fusion on (actors/vllm_args.py NO_MULTICAST_PASSES), in this order, a few of
# each kind (bench/records/tensor-parallel-multicast.txt, section plain-script-tp2-fusion-on-symm-mem-off.log); the
# warning below is a made-up one of the same form: a warning that names an error is never the root cause
TENSOR_PARALLEL_FAILURE = START_REPORT + """\
(Worker_TP0 pid=5167) INFO 11-27 10:30:35 [flashinfer_all_reduce.py:121] Auto-selected flashinfer allreduce backend: mnnvl
(Worker pid=5168) WARNING 11-27 10:30:25 [symm_mem.py:106] SymmMemCommunicator: symmetric memory multicast operations are not supported.
(Worker pid=5168) WARNING 11-27 10:30:26 [example.py:1] RuntimeError: a retried probe, not the failure
(Worker_TP1 pid=5168) ERROR 11-27 10:31:40 [multiproc_executor.py:1007]   File "/var/tmp/site/vllm/v1/worker/gpu_worker.py", line 412, in compile_or_warm_up_model
(Worker_TP1 pid=5168) ERROR 11-27 10:31:40 [multiproc_executor.py:1007] RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasCreate(handle)`
(EngineCore pid=4823) ERROR 11-27 10:31:40 [core.py:1330]     raise RuntimeError(
(EngineCore pid=4823) ERROR 11-27 10:31:40 [core.py:1330] RuntimeError: Worker failed with error 'CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasCreate(handle)`', please check the stack trace above for the root cause
(Worker_TP1 pid=5168) torch.AcceleratorError: CUDA error: an illegal memory access was encountered
terminate called after throwing an instance of 'c10::AcceleratorError'
  what():  CUDA error: an illegal memory access was encountered
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x9d (0x7f9d22d7305d in /opt/torch/.venv/lib/python3.12/site-packages/torch/lib/libc10.so)
"""


def test_a_tensor_parallel_start_failure_names_the_workers_first_error_not_a_cpp_frame():
    """The engine's error names the first exception a worker raised, not the C++ frame printed last nor the
    CUDA error that followed it nor a warning's: the line a user reads in the shard's error and the run's line."""
    line = _failure_line(ENGINE_CORE_FAILED, TENSOR_PARALLEL_FAILURE)
    assert line == "RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasCreate(handle)`"
    error = with_root_cause(ENGINE_CORE_FAILED, TENSOR_PARALLEL_FAILURE)
    assert str(error).startswith(line) and "frame #" not in str(error) and "c10::" not in str(error)


def test_a_tensor_parallel_engine_runs_without_vllms_multicast_all_reduce_fusion_unless_the_spec_asks():
    """vLLM's FlashInfer all-reduce fusion (its `mnnvl` backend needs NVLink multicast) is off for an engine across
    GPUs; a one-GPU engine is left as vLLM has it; a spec that sets the pass itself keeps its value."""
    from actors.engine import EngineProfile
    from actors.vllm_args import NO_MULTICAST_PASSES, engine_args
    from cluster.contracts.spec import ModelSpec

    def passes(engine: dict) -> dict | None:
        args = engine_args(ModelSpec("m", "/m", engine=engine), "/m", EngineProfile(), 1.0)
        return args["compilation_config"].get("pass_config")

    assert passes({"tensor_parallel_size": 2}) == NO_MULTICAST_PASSES == {"fuse_allreduce_rms": False}
    assert passes({"tensor_parallel_size": 4, "compilation_config": {"pass_config": {"fuse_allreduce_rms": True}}}) \
        == {"fuse_allreduce_rms": True}
    assert passes({}) is None and passes({"pipeline_parallel_size": 2}) is None


@pytest.mark.parametrize("given, mode", [(3, 3), (0, 0)])
def test_an_integer_compilation_config_is_the_mode_vllm_reads_it_as(given, mode):
    """`compilation_config: 3` was `dict(3)`, a TypeError as the engine started; `0` was read as none given."""
    from actors.engine import EngineProfile
    from actors.vllm_args import engine_args
    from cluster.contracts.spec import ModelSpec

    args = engine_args(ModelSpec("m", "/m", engine={"compilation_config": given}), "/m", EngineProfile(), 0.5)
    assert args["compilation_config"]["mode"] == mode


def test_the_batch_limit_is_vllms_own_on_a_whole_gpu_and_raysweeps_on_a_share_of_one():
    """A whole GPU: no `max_num_seqs` and no capture size, so vLLM picks both for the GPU as a plain `LLM(...)`
    gets them; a shared GPU or reproducible mode: DEFAULT_MAX_SEQS, captured to it; the long profile at most LONG_MAX_SEQS; the
    spec's value wherever it sets one."""
    from actors.engine import EngineProfile
    from actors.vllm_args import LONG_MAX_SEQS, engine_args
    from cluster.contracts.engine_defaults import DEFAULT_MAX_SEQS
    from cluster.contracts.spec import ModelSpec

    def batch(engine: dict, fraction: float, profile=EngineProfile(), reproducible: bool = False) -> tuple:
        args = engine_args(ModelSpec("m", "/m", engine=engine), "/m", profile, fraction, reproducible=reproducible)
        return args.get("max_num_seqs"), args["compilation_config"].get("max_cudagraph_capture_size")

    long = EngineProfile("long", True, 2048)
    assert batch({}, 1.0) == (None, None)
    assert batch({}, 0.25) == batch({}, 1.0, reproducible=True) == (DEFAULT_MAX_SEQS, DEFAULT_MAX_SEQS)
    assert batch({}, 1.0, long) == (LONG_MAX_SEQS, LONG_MAX_SEQS)
    assert batch({"max_num_seqs": 32}, 1.0) == batch({"max_num_seqs": 32}, 0.5) == (32, 32)
    assert batch({"max_num_seqs": 512, "compilation_config": {"max_cudagraph_capture_size": 128}}, 1.0) == (512, 128)


def test_a_large_models_engine_starts_uncompiled_with_full_decode_graphs_unless_the_spec_or_reproducible_decides(
        tmp_path):
    """Weights over UNCOMPILED_MIN_WEIGHT_BYTES as vLLM loads them (parameters from the safetensors headers, at
    the config's dtype, float32 loaded as bfloat16: as the planner counts them): vLLM's compilation mode 0 and full
    CUDA graphs for decode steps (on a shared GPU with its capture size: the arguments measured on an H200); a
    smaller model (a float32 checkpoint whose files alone are over the bound among them), a folder without a
    config, a spec that sets the mode, the graph mode, enforce_eager or an optimization level, reproducible
    mode, and a model asked for log-likelihoods keep what they had."""
    import json
    import struct

    from actors.engine import EngineProfile
    from actors.vllm_args import UNCOMPILED, engine_args
    from cluster.contracts.engine_defaults import DEFAULT_MAX_SEQS, UNCOMPILED_MIN_WEIGHT_BYTES
    from cluster.contracts.spec import ModelSpec

    def model(name: str, parameters: int, dtype: str, config: bool = True):
        """A folder of two safetensors files of `parameters` in all, headers only (their tensors' bytes unread)."""
        folder = tmp_path / name
        folder.mkdir()
        for i, n in enumerate((parameters // 2, parameters - parameters // 2)):
            head = json.dumps({"w": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
            (folder / f"model-0000{i + 1}-of-00002.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
        if config:
            (folder / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
        return folder

    over = UNCOMPILED_MIN_WEIGHT_BYTES // 2 + 1024  # parameters: over the bound at two bytes each
    large, small = model("large", over, "bfloat16"), model("small", over // 2, "bfloat16")
    float32 = model("float32", over * 3 // 4, "float32")  # files over the bound at four bytes; loaded as bf16, under

    def compilation(path, engine=None, fraction=1.0, reproducible=False) -> dict:
        model = ModelSpec("m", str(path), engine=engine or {})
        return engine_args(model, str(path), EngineProfile(), fraction, reproducible=reproducible)["compilation_config"]

    assert compilation(large) == UNCOMPILED == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert compilation(large, fraction=0.5) == {**UNCOMPILED, "max_cudagraph_capture_size": DEFAULT_MAX_SEQS}
    assert compilation(large, {"compilation_config": {"pass_config": {"eliminate_noops": False}}}) == \
        {**UNCOMPILED, "pass_config": {"eliminate_noops": False}}
    assert compilation(small) == compilation(float32) == compilation(tmp_path / "absent") == {}
    assert compilation(model("unconfigured", over, "bfloat16", config=False)) == {}
    assert compilation(float32, {"dtype": "float32"}) == UNCOMPILED  # loaded as stored: four bytes each
    assert compilation(large, {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}) == \
        {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert compilation(large, {"compilation_config": {"mode": 3}}) == {"mode": 3}
    assert compilation(large, {"enforce_eager": True}) == compilation(large, {"optimization_level": 2}) == {}
    assert "mode" not in compilation(large, reproducible=True)
    asked = engine_args(ModelSpec("m", str(large), loglikelihood=True), str(large), EngineProfile(), 1.0)
    assert asked["compilation_config"] == {}  # log-likelihoods asked of it: vLLM's compiled default, as lm-eval's


def test_a_model_folders_config_is_none_where_it_cannot_be_read(tmp_path):
    """cluster/contracts/model_memory.py folder_config: what the engine's GPU check and its compile choice read."""
    from cluster.contracts.model_memory import folder_config

    for name, text in (("good", '{"torch_dtype": "bfloat16"}'), ("list", "[1]"), ("broken", "{")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    assert folder_config(str(tmp_path / "good")) == {"torch_dtype": "bfloat16"}
    assert folder_config(str(tmp_path / "list")) is folder_config(str(tmp_path / "broken")) is None
    assert folder_config(str(tmp_path / "absent")) is None


def test_every_engine_process_gets_raysweeps_vllm_settings_unless_set():
    """Symmetric-memory all-reduce and FlashInfer's sampler off (actors/vllm_args.py ENGINE_ENV), set before vLLM
    is imported, so the engine core and its workers read them; a value the user set is kept."""
    import subprocess
    import sys

    names = ("VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_USE_FLASHINFER_SAMPLER")
    probe = ("import os; from actors import vllm_core_process as v; os.environ['RAYSWEEP_VLLM_CORE'] = 'inprocess'; "
             f"v.start(); print(*(os.environ[n] for n in {names!r}))")
    env = {k: v for k, v in os.environ.items() if k not in names}

    def seen(env: dict) -> str:  # start() routes the process's stdout through its tee to stderr
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        return (done.stdout + done.stderr).strip().splitlines()[-1]

    assert seen(env) == "0 0"
    assert seen({**env, "VLLM_ALLREDUCE_USE_SYMM_MEM": "1", "VLLM_USE_FLASHINFER_SAMPLER": "1"}) == "1 1"


def test_an_engine_that_dies_without_closing_kills_its_engine_cores_first():
    """The engine thread's error path exits the process at once (`os._exit`); the engine core processes it
    started are killed first, so none keeps the GPU's memory; one already gone does not stop the others."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from actors.vllm_engine import VllmEngine

    class Gone:
        def kill(self):
            raise ProcessLookupError("no such process")

    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        engine = object.__new__(VllmEngine)
        manager = SimpleNamespace(processes=[Gone(), core])
        engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))))
        engine.kill_engine_cores()
        assert core.wait(timeout=30) == -9
        engine.llm = None  # closed already: nothing to kill
        engine.kill_engine_cores()
    finally:
        if core.poll() is None:
            core.kill()


def _engine_thread_over(enqueue, step):
    """A VllmEngine with `exit_on_error=False` whose `LLM` is a stand-in: `enqueue(prompts)` and `step()` as
    vLLM's `LLM.enqueue` and `LLMEngine.step` (vLLM's request ids: "<request id>-<8 random characters>")."""
    from types import SimpleNamespace

    from actors.vllm_engine import VllmEngine
    from actors.vllm_inbox import Inbox

    class Engine:  # vLLM's LLMEngine as the engine thread uses it
        vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
        held = 0

        def has_unfinished_requests(self):
            return self.held > 0

        def get_num_unfinished_requests(self):
            return self.held

        def step(self):
            return step()

    llm_engine = Engine()

    def queued(prompts, params, use_tqdm):
        enqueue(prompts)
        llm_engine.held += len(prompts)
        return [f"r{llm_engine.held - len(prompts) + i}-abcdefgh" for i in range(len(prompts))]

    engine = object.__new__(VllmEngine)
    engine.llm = SimpleNamespace(llm_engine=llm_engine, enqueue=queued)
    engine.exit_on_error, engine._closing, engine._inbox, engine.steps, engine.batch_sum = False, False, Inbox(), 0, 0
    return engine


def _callers_and_engine_thread(engine, batches: list[list[str]]) -> list[str]:
    """Each batch of request ids submitted from a thread of its own while the engine thread runs; every thread
    ends within 30 s; what the callers raised."""
    import threading

    from actors.engine import GenRequest
    from actors.vllm_inbox import Batch

    raised = []

    def caller(ids: list) -> None:
        try:
            engine._inbox.submit(Batch([GenRequest(i, [1, 2], 0) for i in ids], [None] * len(ids)))
        except RuntimeError as e:
            raised.append(str(e))

    threads = [threading.Thread(target=caller, args=(ids,), daemon=True) for ids in batches]
    threads.append(threading.Thread(target=engine._run, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    return raised


def test_an_engine_told_not_to_exit_fails_the_waiting_calls_and_every_later_one_with_its_error():
    """`exit_on_error=False` (an engine in a process that must go on: the GPU tests' own): where vLLM's step
    raises, the callers waiting on their batches get the engine's error, as does a call made afterwards, a sleep
    included; nothing waits forever and the process lives."""
    from actors.engine import GenRequest
    from actors.vllm_inbox import Batch

    def step():
        raise ValueError("MessagePack data is malformed")

    engine = _engine_thread_over(lambda prompts: None, step)
    raised = _callers_and_engine_thread(engine, [["r0", "r1"], ["r2"]])
    assert len(raised) == 2 and all("ValueError('MessagePack data is malformed')" in r for r in raised)
    with pytest.raises(RuntimeError, match="failed earlier: ValueError"):
        engine._inbox.submit(Batch([GenRequest("r3", [4], 0)], [None]))
    with pytest.raises(RuntimeError, match="failed earlier"):
        engine.sleep()


def test_a_batch_whose_enqueue_raises_fails_with_the_engine_error_rather_than_waiting_forever():
    """`exit_on_error=False`: vLLM refusing a batch as it is handed in (its `enqueue` raises) ends the engine
    thread like a failed step does; the batch's caller gets the error, it is never left out of every list."""
    def enqueue(prompts):
        raise ValueError("prompt longer than max_model_len")

    raised = _callers_and_engine_thread(_engine_thread_over(enqueue, lambda: []), [["r0"]])
    assert raised and "prompt longer than max_model_len" in raised[0]
