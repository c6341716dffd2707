"""Engines that cannot start, on CPUs (the fake engine's `fail_start` and `start_s`): a start that raises fails
its model's shards with the engine's own error, a start that hangs ends its actor after
RAYSWEEP_ENGINE_START_TIMEOUT_S, each said in one line of the run, and the other model's samples all land."""

import pyarrow.parquet as pq
import pytest

from cluster.inputs.spec_file import load_spec
from cluster.schedule.engine_starts import ENV, StartTimeoutSetting, start_timeout_s, take_overdue, timed_out_line
from cluster.schedule.work import Slot

from tests.test_parallel import write_spec


@pytest.mark.slow
def test_an_engine_that_raises_and_one_that_hangs_each_fail_their_model_in_one_line(engine_host, ray_local, tmp_path,
                                                                                    monkeypatch):
    from cluster.schedule.run import run_sweep

    # every start here is a fake's: an error at once, or a tokenizer read (0.85 s to be answered on an idle 2-core
    # machine, 4.5 s beside other suites; its transformers imports are done before the start is asked for). A
    # start of a tokenizer with those imports still in it (1.9 s idle) once took over 20 s beside a second suite
    # and two CPU burners: the bound is twice that, and the stuck start far beyond it
    monkeypatch.setenv(ENV, "45")
    models = [{"name": "good", "path": "builtin:tiny", "engine": {"backend": "fake"}},
              {"name": "broken", "path": "builtin:tiny", "engine": {"backend": "fake", "fail_start": "NCCL error: no GPU"}},
              {"name": "stuck", "path": "builtin:tiny", "engine": {"backend": "fake", "start_s": 3600}}]
    spec = load_spec(write_spec(tmp_path, models, rows=20, actors={"count": 1, "num_cpus": 0.5}))
    lines: list[str] = []
    report = run_sweep(spec, engine_host=engine_host, log=lines.append)
    said = [line for line in lines if line.startswith("[raysweep] model ")]
    assert sorted(said) == [
        "[raysweep] model broken: engine did not start: RuntimeError: NCCL error: no GPU; its shards fail, the other "
        "models go on",
        f"[raysweep] model stuck: {timed_out_line(45.0)}; its shards fail, the other models go on"]
    assert sorted(report.failed) == ["broken/t/00000", "broken/t/00001", "stuck/t/00000", "stuck/t/00001"]
    assert {e["errors"][-1] for e in report.failed.values()} == {
        "engine did not start: RuntimeError: NCCL error: no GPU", timed_out_line(45.0)}
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert sorted(results[results.model == "good"]["sample_id"]) == sorted(f"s{i}" for i in range(20))
    assert set(results["model"]) == {"good"}


def test_the_bound_is_read_from_the_environment_and_a_bad_one_is_one_line(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert start_timeout_s() == 900.0
    monkeypatch.setenv(ENV, "30")
    assert start_timeout_s() == 30.0
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(StartTimeoutSetting, match=ENV):
            start_timeout_s()


def test_only_starts_past_the_bound_are_taken():
    early, late, shard = Slot(None, 1, start_at=100.0), Slot(None, 2, start_at=10.0), Slot(None, 3, start_at=10.0)
    inflight = {"a": ("start", None, early), "b": ("start", None, late), "c": ("shard", object(), shard)}
    assert take_overdue(inflight, 60.0, now=120.0) == [late]
    assert list(inflight) == ["a", "c"]


def test_a_start_whose_answer_is_in_but_not_collected_is_not_overdue():
    """The loop collects one answer a turn: a start answered in time, still waiting to be collected when the bound
    passes, is collected as it came, not stopped as hung."""
    answered_late, hung = Slot(None, 1, start_at=10.0), Slot(None, 2, start_at=10.0)
    inflight = {"a": ("start", None, answered_late), "b": ("start", None, hung)}
    assert take_overdue(inflight, 60.0, now=120.0, answered=lambda ref: ref == "a") == [hung]
    assert list(inflight) == ["a"]
