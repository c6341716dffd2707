"""GPU tests of many GPUs of one host (skipped with fewer): a tensor-parallel engine beside a one-GPU engine in
one sweep, and one across four GPUs. A module of their own: tests/test_gpu.py's engine holds a share of GPU 0
for its whole module."""

import json

import pytest

from tests.conftest import gpu_count

pytestmark = [pytest.mark.gpu]


@pytest.mark.slow
@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_sweep_beside_a_one_gpu_model(ray_local, tmp_path):
    """builtin:small at tensor_parallel_size 2 (one actor holding both GPUs, vLLM's workers inside it) and
    builtin:tiny on one GPU, in one sweep: every sample of each exactly once; the TP actor held 2 GPUs; with 3 GPUs
    or more, neither engine waited for the other's GPUs (a small model's shards may all end before a TP engine
    is up, so the starts are compared, not the shards)."""
    import pyarrow.parquet as pq

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec
    from benchmarks.common import prompts_of

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n"
                            for i, t in enumerate(prompts_of(300, 64, 1024, seed=13))))
    spec = {"name": "tp2", "output": str(tmp_path / "out"),
            "models": [{"name": "wide", "path": "builtin:small", "engine": {"backend": "vllm", "tensor_parallel_size": 2}},
                       {"name": "narrow", "path": "builtin:tiny", "engine": {"backend": "vllm"}}],
            "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "{text}",
                       "sampling": {"max_tokens": 32}}],
            "shards": {"max_samples": 50}, "actors": {"count": 1, "num_gpus": 1}}
    (tmp_path / "tp2.yaml").write_text(json.dumps(spec))
    report = run_sweep(load_spec(tmp_path / "tp2.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 600 and not results.duplicated(["model", "sample_id"]).any()
    actors = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    print(actors[["model", "gpus", "gpu_ids", "requested_at", "ready_at", "startup_s"]].to_string())
    assert set(actors[actors.model == "wide"]["gpus"]) == {2} and set(actors[actors.model == "narrow"]["gpus"]) == {1}
    if gpu_count() >= 3:  # room for both at once: their engines started side by side, on GPUs of their own
        first = actors.sort_values("requested_at").groupby("model").first()
        wide, narrow = first.loc["wide"], first.loc["narrow"]
        assert wide.requested_at < narrow.ready_at and narrow.requested_at < wide.ready_at, first
        assert not set(wide.gpu_ids.split(",")) & set(narrow.gpu_ids.split(","))


@pytest.mark.slow
@pytest.mark.skipif(gpu_count() < 4, reason="needs 4 GPUs")
def test_tensor_parallel_4_sweep(ray_local, tmp_path):
    """builtin:small at tensor_parallel_size 4: one actor holds four GPUs, every sample exactly once."""
    import pyarrow.parquet as pq

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec
    from benchmarks.common import prompts_of

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n"
                            for i, t in enumerate(prompts_of(200, 64, 1024, seed=14))))
    spec = {"name": "tp4", "output": str(tmp_path / "out"),
            "models": [{"name": "wide", "path": "builtin:small", "engine": {"backend": "vllm", "tensor_parallel_size": 4}}],
            "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "{text}",
                       "sampling": {"max_tokens": 32}}],
            "shards": {"max_samples": 50}}
    (tmp_path / "tp4.yaml").write_text(json.dumps(spec))
    report = run_sweep(load_spec(tmp_path / "tp4.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 200 and not results.duplicated(["sample_id"]).any() and set(results["status"]) == {"ok"}
    actors = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    print(actors[["model", "gpus", "gpu_ids", "startup_s"]].to_string())
    assert set(actors["gpus"]) == {4}
