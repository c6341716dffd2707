"""The sink without Ray: journaled commits survive a driver that dies before it finishes (a torn last
line included), and the summary accumulated shard by shard equals one computed over all rows at once."""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.score.summary import summarize
from cluster.store.manifest import JOURNAL, read_manifest
from cluster.store.sink import ResultSink
from cluster.inputs.spec_file import load_spec
from tests.conftest import QUICKSTART


def shard_table(task: str, index: int, rng: random.Random) -> pa.Table:
    n = rng.randint(1, 9)
    status = [rng.choice(["ok", "ok", "ok", "error", "skipped", "truncated"]) for _ in range(n)]
    return pa.Table.from_pydict({
        "model": [f"m{index % 2}"] * n, "task": [task] * n, "sample_id": [f"{task}-{index}-{i}" for i in range(n)],
        "status": status,
        "score": [None if s in ("error", "skipped") else float(rng.random() < 0.4) for s in status],
        "structured_valid": [None if task == "free" or s != "ok" else rng.random() < 0.9 for s in status],
        "output_tokens": [None if s == "skipped" else rng.randint(1, 50) for s in status],
    }, schema=pa.schema([("model", pa.string()), ("task", pa.string()), ("sample_id", pa.string()),
                         ("status", pa.string()), ("score", pa.float64()), ("structured_valid", pa.bool_()),
                         ("output_tokens", pa.int32())]))


def test_journal_survives_a_dead_driver_and_the_summary_is_exact(tmp_path):
    spec, out, rng = load_spec(QUICKSTART), tmp_path / "out", random.Random(7)
    tables = {f"m/{task}/{i:05d}": shard_table(task, i, rng) for task in ("free", "json") for i in range(40)}
    ids = sorted(tables)
    sink = ResultSink(str(out), spec)
    sink.plan(ids)
    for sid in ids[:50]:
        sink.commit(sid, *sid.split("/")[:2], int(sid.split("/")[2]), tables[sid], attempts=1)
    sink.fail(ids[50], ["RuntimeError: boom"])
    sink._journal.write('{"shard_id": "m/free/00099", "state": "comm')  # killed mid-line
    sink._journal.flush()
    sink._lock.close()  # the driver dies: no finish(), manifest.json still says every shard is pending

    assert (out / JOURNAL).exists()
    manifest = read_manifest(str(out))
    assert sum(s["state"] == "committed" for s in manifest["shards"].values()) == 50
    assert manifest["shards"][ids[50]]["state"] == "failed" and "m/free/00099" not in manifest["shards"]

    with ResultSink(str(out), spec) as again:  # the re-run: resumes from manifest.json + journal
        assert again.committed() == set(ids[:50])
        again.plan(ids)
        assert not (out / JOURNAL).exists()  # taken into manifest.json
        for sid in ids[50:]:
            again.commit(sid, *sid.split("/")[:2], int(sid.split("/")[2]), tables[sid], attempts=2)
        summary = again.finish()  # 50 shards read back from the earlier run, 30 accumulated in this one
    expected = summarize(pa.concat_tables(tables.values()))
    assert summary.num_rows == expected.num_rows == 4
    for got, want in zip(summary.to_pylist(), expected.to_pylist()):
        assert got.keys() == want.keys()
        for key in got:
            assert got[key] == (pytest.approx(want[key]) if isinstance(want[key], float) else want[key]), key
    assert pq.read_table(out / "summary.parquet").num_rows == 4
    assert sorted(read_manifest(str(out))["shards"]) == ids and not (out / JOURNAL).exists()


def test_summary_by_hand():
    t = pa.table({"model": ["m"] * 4, "task": ["t"] * 4, "status": ["ok", "ok", "ok", "error"],
                  "score": [1.0, 0.0, 1.0, None], "structured_valid": [True, False, True, None],
                  "output_tokens": [3, 4, 5, None]})
    row = summarize(t).to_pylist()[0]
    assert row["n"] == 4 and row["n_scored"] == 3 and row["n_error"] == 1 and row["output_tokens"] == 12
    assert row["score"] == pytest.approx(2 / 3)
    assert row["stderr"] == pytest.approx(((1 / 3) ** 0.5) / 3 ** 0.5)  # sample var 1/3, over sqrt(3)
    assert row["structured_valid_rate"] == pytest.approx(2 / 3)


def test_telemetry_keeps_every_column_when_a_failed_attempts_short_row_comes_first(tmp_path):
    """A failed attempt's row has a few columns; the next shard's full row, flushed with it, keeps all of
    its own; parts flushed as shards commit and the rows still in memory end in one table."""
    import pyarrow.parquet as pq

    from cluster.store.sink import ResultSink
    from cluster.inputs.spec_file import load_spec
    from tests.conftest import QUICKSTART

    with ResultSink(str(tmp_path / "out"), load_spec(QUICKSTART)) as sink:
        sink.add_telemetry("shards", {"shard_id": "s0", "attempt": 1, "error": "actor died"})
        sink.add_telemetry("shards", {"shard_id": "s1", "attempt": 1, "error": None, "wall_s": 2.5, "output_tokens": 9})
        sink.flush_telemetry()
        sink.add_telemetry("shards", {"shard_id": "s0", "attempt": 2, "error": None, "wall_s": 1.5, "output_tokens": 7})
        sink.finish()
    rows = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pylist()
    assert [(r["shard_id"], r["attempt"], r["wall_s"], r["output_tokens"]) for r in rows] == \
        [("s0", 1, None, None), ("s1", 1, 2.5, 9), ("s0", 2, 1.5, 7)]
    assert not list((tmp_path / "out" / "telemetry" / ".pending").iterdir())


def test_engine_starts_are_on_disk_as_they_happen_and_their_first_tokens_fold_in(tmp_path):
    """A driver killed mid-sweep loses no telemetry/actors row: each is written as its engine starts, its
    first_token_s (known only once a shard comes back) as a small update; the next run's finish() folds
    the earliest update into its row, every row once."""
    from cluster.store.telemetry_store import FIRST_TOKENS

    spec, out = load_spec(QUICKSTART), tmp_path / "out"
    sink = ResultSink(str(out), spec)
    sink.add_telemetry("actors", {"actor_id": "a", "start_index": 0, "model": "tiny", "first_token_s": None})
    sink.flush_telemetry(("actors",))  # as the engine starts
    for seconds in (0.5, 0.3):
        sink.add_telemetry(FIRST_TOKENS, {"actor_id": "a", "start_index": 0, "first_token_s": seconds})
    sink.add_telemetry("actors", {"actor_id": "a", "start_index": 1, "model": "tiny", "first_token_s": None})
    sink.flush_telemetry()  # as a shard commits
    sink._lock.close()  # the driver dies: no finish()

    with ResultSink(str(out), spec) as again:  # the resume: one engine start of its own
        again.add_telemetry("actors", {"actor_id": "b", "start_index": 0, "model": "tiny", "first_token_s": None})
        again.flush_telemetry(("actors",))
        again.add_telemetry(FIRST_TOKENS, {"actor_id": "b", "start_index": 0, "first_token_s": 0.2})
        again.finish()
    rows = pq.read_table(out / "telemetry" / "actors.parquet").to_pylist()
    assert sorted((r["actor_id"], r["start_index"], r["first_token_s"]) for r in rows) == \
        [("a", 0, 0.3), ("a", 1, None), ("b", 0, 0.2)]
    assert not list((out / "telemetry" / ".pending").iterdir())
    assert not (out / "telemetry" / f"{FIRST_TOKENS}.parquet").exists()  # updates are folded in, not a table


def test_a_part_torn_by_a_killed_driver_is_dropped_when_the_next_run_finishes(tmp_path):
    """kill -9 while a telemetry part is being written leaves its `.tmp` (seen once in the kill-and-resume
    test): the resume's finish() deletes it; its rows belonged to no committed shard."""
    spec, out = load_spec(QUICKSTART), tmp_path / "out"
    sink = ResultSink(str(out), spec)
    sink.add_telemetry("shards", {"shard_id": "tiny/arithmetic/00000", "wall_s": 1.0})
    sink.flush_telemetry()
    pending = out / "telemetry" / ".pending"
    (pending / "shards-01795363731876701308-beb37c89.parquet.tmp").write_bytes(b"")  # torn mid-write
    sink._lock.close()  # the driver dies: no finish()

    with ResultSink(str(out), spec) as again:
        again.finish()
    assert not list(pending.iterdir())
    assert pq.read_table(out / "telemetry" / "shards.parquet").num_rows == 1


def test_a_bisected_shard_over_its_policy_is_committed_and_fails_the_sweep_on_every_run(tmp_path):
    spec, out = load_spec(QUICKSTART), tmp_path / "out"
    table = shard_table("free", 0, random.Random(1))
    with ResultSink(str(out), spec) as sink:
        sink.plan(["m0/free/00000", "m0/free/00001"])
        sink.commit("m0/free/00000", "m0", "free", 0, table, 2, {"row_errors": {"free-0-0": "RuntimeError: boom"},
                                                              "errors": ["1 of 3 rows failed"]})
        sink.fail("m0/free/00001", ["RuntimeError: down"])
        assert set(sink.failed()) == {"m0/free/00000", "m0/free/00001"}
    with ResultSink(str(out), spec) as again:
        again.plan(["m0/free/00000", "m0/free/00001"])  # a re-run tries the failed shard again, not the committed one
        assert again.committed() == {"m0/free/00000"} and set(again.failed()) == {"m0/free/00000"}
        assert again.failed()["m0/free/00000"]["errors"] == ["1 of 3 rows failed"]


def test_a_plan_refuses_an_entry_of_its_task_it_does_not_have(tmp_path):
    """The same spec and data plan the same shards: an entry of the task beyond them (a hand-made one, with a file of
    its own) would have its rows counted beside the plan's."""
    from cluster.store.output_files import SinkError

    spec, out = load_spec(QUICKSTART), tmp_path / "out"
    table = shard_table("free", 0, random.Random(1))
    with ResultSink(str(out), spec) as sink:
        sink.plan(["m0/free/00000", "m0/free/00099"])
        sink.commit("m0/free/00099", "m0", "free", 99, table, 1)
    with ResultSink(str(out), spec) as again:
        with pytest.raises(SinkError, match="shard m0/free/00099 is not one of the 1 shard\\(s\\) this spec and data "
                                            "plan for m0/free"):
            again.plan(["m0/free/00000"])
        again.plan(["m0/other/00000"])  # another task's plan: not its business


def test_a_folder_that_is_not_a_sweeps_output_is_refused_and_left_alone(tmp_path):
    """results/ without manifest.json: someone else's files; neither a run nor --new-run touches them."""
    from cluster.store.output_files import SinkError

    spec = load_spec(QUICKSTART)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("precious")
    for new_run in (False, True):
        with pytest.raises(SinkError, match="no manifest.json, so it is not a raysweep output"):
            ResultSink(str(tmp_path), spec, new_run=new_run)
    assert (tmp_path / "results" / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no lock, no manifest left behind


def test_an_output_uri_that_cannot_be_opened_is_one_error():
    from cluster.store.output_files import SinkError

    with pytest.raises(SinkError, match="output foo://bar/x: cannot be opened"):
        ResultSink("foo://bar/x", load_spec(QUICKSTART))


def test_another_specs_output_that_committed_nothing_is_taken_over(tmp_path):
    """A run refused after the output was opened (say, a bad regex found after Ray started) committed
    nothing: the fixed spec may use the same output. One that committed shards is still refused."""
    from cluster.store.output_files import SinkError

    spec = load_spec(QUICKSTART)
    with ResultSink(str(tmp_path), spec) as sink:
        sink.plan(["tiny/arithmetic/00000"])
    other = load_spec(QUICKSTART)
    object.__setattr__(other, "name", "fixed")
    with ResultSink(str(tmp_path), other) as sink:
        assert sink.manifest["sweep"] == "fixed" and sink.manifest["shards"] == {}
        sink.plan(["tiny/arithmetic/00000"])
        table = pa.table({"model": ["tiny"], "task": ["arithmetic"], "sample_id": ["a"], "status": ["ok"],
                          "score": [1.0], "structured_valid": pa.array([None], pa.bool_()),
                          "output_tokens": pa.array([1], pa.int32())})
        sink.commit("tiny/arithmetic/00000", "tiny", "arithmetic", 0, table, 1)
    with pytest.raises(SinkError, match="holds results of another spec"):
        ResultSink(str(tmp_path), spec)
