"""One scheduler over every model (issue: whole-sweep speed), on a real local Ray with 2 CPUs and the CPU
engine: models side by side, a finished model's actor handed to a model with work left (a counted model
change), start-up figures that add up, an engine that cannot start failing only its own model, and a
spec no node can hold refused before any engine starts."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
import yaml

from cluster.schedule.run import run_sweep
from cluster.inputs.spec_file import load_spec


def two_model_spec(tmp_path, models, rows=48, actors=None, max_tokens=6):
    """`models` (name, path, backend) x one task of `rows` rows in shards of 6, on 2 one-CPU actors."""
    data = [{"id": f"s{i}", "text": f"sample number {i} says"} for i in range(rows)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / "two.yaml").write_text(yaml.safe_dump({
        "name": "two-models", "output": str(tmp_path / "out"),
        "models": [{"name": name, "path": path, "engine": backend} for name, path, backend in models],
        "tasks": [{"name": "t", "data": "d.jsonl", "id_column": "id", "prompt": "{text}",
                   "sampling": {"max_tokens": max_tokens}}],
        "shards": {"max_samples": 6}, "actors": actors or {"count": 2, "num_cpus": 1}}))
    return load_spec(tmp_path / "two.yaml")


@pytest.fixture(scope="module")
def two_models(engine_host, ray_local, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-models")
    # enough work per model (several seconds on the CPU engine) that the second actor, whose imports may
    # finish seconds after the first's on a loaded machine, comes up while the first model still runs
    spec = two_model_spec(tmp, [("a", "builtin:tiny", "hf"), ("b", "builtin:tiny", "hf")], rows=96, max_tokens=48)
    return run_sweep(spec, engine_host=engine_host, log=lambda line: None), tmp / "out"


@pytest.mark.slow
def test_both_models_run_at_once_and_every_sample_lands_once(two_models):
    report, out = two_models
    assert not report.failed and report.samples == 2 * 96
    results = pq.read_table(out / "results").to_pandas()
    keys = list(zip(results["model"].astype(str), results["task"].astype(str), results["sample_id"]))
    assert len(keys) == len(set(keys)) == 2 * 96
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    windows = shards.groupby("model").agg(start=("started_at", "min"), end=("finished_at", "max"))
    assert set(windows.index) == {"a", "b"}
    # the two models' shard windows overlap: they ran side by side, not one after the other
    assert windows["start"].max() < windows["end"].min(), windows


@pytest.mark.slow
def test_startup_figures_are_measured_and_add_up(two_models):
    _, out = two_models
    starts = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    first = starts[starts["reason"] == "first"]
    assert len(first) == 2
    phases = ["process_s", "imports_s", "waiting_s", "engine_init_s", "warmup_s"]
    assert first[phases + ["startup_s", "first_token_s"]].notna().all().all(), first[phases]
    for _, row in first.iterrows():
        ran = shards[shards["actor_id"] == row["actor_id"]]
        actor_wall = (ran["finished_at"].max() - row["requested_at"]).total_seconds()
        parts = row[phases].sum()
        assert parts <= row["startup_s"] + 0.05  # the phases are inside the start-up span (+ clock rounding)
        assert row["startup_s"] + row["first_token_s"] <= actor_wall
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["first_result_s"] <= runs[0]["last_result_s"] <= runs[0]["wall_s"]


@pytest.mark.slow
def test_a_finished_models_actor_serves_the_other_model(engine_host, ray_local, tmp_path):
    """`fast` (the fake engine) is done at once; its actor changes model and helps `slow` (CPU engine). `slow`
    has seconds of work (48 new tokens a row): with 6, on a loaded machine its own actor had finished every
    shard before the helper's engine was up."""
    spec = two_model_spec(tmp_path, [("fast", "builtin:tiny", "fake"), ("slow", "builtin:tiny", "hf")], rows=96,
                          max_tokens=48)
    report = run_sweep(spec, engine_host=engine_host, log=lambda line: None)
    assert not report.failed and report.samples == 2 * 96
    starts = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    changed = starts[starts["reason"] == "model"]
    assert report.model_changes >= 1 and len(changed) == report.model_changes, starts[["actor_id", "model", "reason"]]
    assert set(changed["model"]) == {"slow"} and (changed["model_change"] >= 1).all()
    shards = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pandas()
    helper = changed["actor_id"].iloc[0]  # the actor that ran `fast`, then shards of `slow`
    assert set(shards[shards["actor_id"] == helper]["model"]) == {"fast", "slow"}
    # each model's rows came from its own engine, the helper's included: none of slow's from the fake engine it
    # ran before, every one of fast's from it
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    by_model = results.groupby(results["model"].astype(str))["output_text"]
    assert (by_model.get_group("fast") == "fake").all() and not (by_model.get_group("slow") == "fake").any()

    # the report names that actor by both models, in order (it was named by its last one), and its sample
    # browser lists every sample of the task with both models' completions side by side
    from cluster.report.page import write_report
    from tests.test_report import _browser_data, _table_rows

    page = write_report(str(tmp_path / "out")).read_text()
    lanes = [row[0] for row in _table_rows(page, "timeline-actors")]
    assert f"fast → slow · {helper[:8]}" in lanes, lanes
    browser = _browser_data(page)
    assert browser["columns"] == ["fast", "slow"] and browser["tasks"]["t"]["rows"] == 96
    shown = browser["tasks"]["t"]["shown"]
    assert len(shown) == 96 and all(r["cells"][0]["output"] == "fake" and r["cells"][1]["status"] == "ok" for r in shown)


@pytest.mark.slow
def test_an_engine_that_cannot_start_fails_only_its_model(engine_host, ray_local, tmp_path, tiny_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # config and tokenizer still load
    spec = two_model_spec(tmp_path, [("broken", str(broken), "hf"), ("good", "builtin:tiny", "hf")], rows=24)
    report = run_sweep(spec, engine_host=engine_host, log=lambda line: None)
    assert sorted(report.failed) == [f"broken/t/{i:05d}" for i in range(4)]  # every shard of the broken model
    assert all("engine did not start" in entry["errors"][-1] for entry in report.failed.values())
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert set(results["model"].astype(str)) == {"good"} and len(results) == 24


@pytest.mark.slow
def test_a_spec_no_node_can_hold_is_refused_before_any_engine(ray_local, tmp_path):
    from cluster.plan.placement import PlacementError

    spec = two_model_spec(tmp_path, [("a", "builtin:tiny", "hf"), ("b", "builtin:tiny", "hf")],
                          actors={"count": 1, "num_gpus": 1, "accelerator_type": "L4"})
    with pytest.raises(PlacementError, match=r"models a, b: an actor needs \{CPU: 1, GPU: 1, "
                                             r"accelerator_type:L4: 0.001\}.*largest has \{CPU: 2"):
        run_sweep(spec, log=lambda line: None)
    assert not (tmp_path / "out" / "telemetry" / "actors.parquet").exists()
