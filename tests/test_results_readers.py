"""Results written by the real ResultSink read as one table, with model and task as strings holding the
right values, through each reader's obvious one-liner (README, "Reading the results"): pyarrow.dataset
(hive), pq.read_table, pandas, polars, DuckDB and Ray Data. All-digit names, which the name rule allows,
are the hard case: a model=13/task=2024 folder made readers infer integers and clash with the files."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.store.manifest import read_manifest
from cluster.store.output_files import SinkError
from cluster.store.sink import ResultSink
from cluster.inputs.spec_file import load_spec
from tests.conftest import QUICKSTART

# one output with an ordinary pair beside the digit names, one with digit names only (there a reader that
# infers a column from the paths finds nothing but integers, and "011" would lose its zero)
OUTPUTS = {"mixed": [("13", "2024"), ("tiny", "arith")], "digits": [("13", "2024"), ("7", "011")]}
ROWS = 3


def _shard(model: str, task: str, index: int) -> pa.Table:
    """A shard's results as cluster/schedule/run.py hands them to the sink (model and task dictionary-encoded)."""
    n = ROWS
    return pa.table({
        "sweep": ["readers"] * n, "model": pa.array([model] * n).dictionary_encode(),
        "task": pa.array([task] * n).dictionary_encode(), "sample_id": [f"{i}" for i in range(n)],
        "shard_id": [f"{model}/{task}/{index:05d}"] * n, "output_text": ["42"] * n,
        "output_tokens": pa.array([2] * n, pa.int32()), "finish_reason": ["stop"] * n, "status": ["ok"] * n,
        "latency_s": [0.1] * n, "ttft_s": [0.01] * n, "error": pa.nulls(n, pa.string()),
        "prompt_tokens": pa.array([5] * n, pa.int32()), "structured": pa.nulls(n, pa.string()),
        "structured_valid": pa.nulls(n, pa.bool_()), "target": ["42"] * n, "score": [1.0] * n,
    })


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    spec, roots = load_spec(QUICKSTART), {}
    for name, pairs in OUTPUTS.items():
        roots[name] = tmp_path_factory.mktemp(name) / "out"
        with ResultSink(str(roots[name]), spec) as sink:
            ids = [f"{m}/{t}/{i:05d}" for m, t in pairs for i in range(2)]
            sink.plan(ids)
            for sid in ids:
                model, task, index = sid.split("/")
                sink.commit(sid, model, task, int(index), _shard(model, task, int(index)), attempts=1)
            sink.finish()
    return roots


def _pyarrow_dataset(results: str) -> pa.Table:
    import pyarrow.dataset as ds

    return ds.dataset(results, format="parquet", partitioning="hive").to_table()


def _pandas(results: str) -> pa.Table:
    import pandas as pd

    return pa.Table.from_pandas(pd.read_parquet(results))


def _polars(results: str) -> pa.Table:
    import polars as pl

    return pl.read_parquet(f"{results}/**/*.parquet", hive_partitioning=True).to_arrow()


def _polars_lazy(results: str) -> pa.Table:
    import polars as pl

    return pl.scan_parquet(f"{results}/**/*.parquet", hive_partitioning=True).collect().to_arrow()


def _duckdb(results: str) -> pa.Table:
    import duckdb

    return duckdb.sql(f"select * from read_parquet('{results}/**/*.parquet', hive_partitioning=true)").to_arrow_table()


READERS = {"pyarrow.dataset": _pyarrow_dataset, "pq.read_table": pq.read_table, "pandas": _pandas,
           "polars": _polars, "polars.scan": _polars_lazy, "duckdb": _duckdb}


def _check(table: pa.Table, pairs: list[tuple[str, str]]) -> None:
    for column in ("model", "task"):
        kind = table.schema.field(column).type
        assert pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind), \
            f"{column} read as {kind}"
    got = sorted(zip(table["model"].to_pylist(), table["task"].to_pylist(), table["shard_id"].to_pylist(),
                     table["sample_id"].to_pylist()))
    want = sorted((m, t, f"{m}/{t}/{i:05d}", f"{r}") for m, t in pairs for i in range(2) for r in range(ROWS))
    assert got == want


@pytest.mark.parametrize("output", sorted(OUTPUTS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_each_reader_reads_model_and_task_as_strings(outputs, output, reader):
    _check(READERS[reader](str(outputs[output] / "results")), OUTPUTS[output])


@pytest.mark.slow
def test_ray_data_reads_them_too(ray_local, outputs):
    for output, root in outputs.items():
        _check(pa.Table.from_pandas(ray_local.data.read_parquet(str(root / "results")).to_pandas()), OUTPUTS[output])


def test_files_lie_in_plain_folders_and_one_file_reads_alone(outputs):
    root = outputs["digits"]
    files = sorted(p.relative_to(root).as_posix() for p in (root / "results").rglob("*.parquet"))
    assert files == [f"results/{m}/{t}/shard-{i:05d}.parquet" for m, t in sorted(OUTPUTS["digits"]) for i in range(2)]
    alone = pq.read_table(root / files[0])  # a single file carries its model and task
    assert alone["model"].to_pylist() == ["13"] * ROWS and alone.schema.field("task").type == pa.string()
    manifest = read_manifest(str(root))
    assert sorted(s["file"] for s in manifest["shards"].values()) == files


def test_an_output_in_the_old_hive_layout_is_refused_with_one_line(outputs, tmp_path):
    """Results of an earlier raysweep (results/model=M/task=T/) cannot be resumed into: new shards in the new
    layout beside them would not read as one table. The report and the summary still read them (by the
    manifest's file paths)."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(outputs["mixed"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"].values():
        model, task, name = entry["file"].split("/")[1:]
        old = f"results/model={model}/task={task}/{name}"
        (out / old).parent.mkdir(parents=True, exist_ok=True)
        (out / entry["file"]).rename(out / old)
        entry["file"] = old
    (out / "manifest.json").write_text(json.dumps(manifest))
    from cluster.report.page import write_report

    assert "arith" in Path(write_report(str(out))).read_text()  # read by the manifest's paths: any layout
    with pytest.raises(SinkError, match=r"earlier raysweep's layout \(results/model=.*--new-run"):
        ResultSink(str(out), load_spec(QUICKSTART))
    with ResultSink(str(out), load_spec(QUICKSTART), new_run=True) as sink:
        assert sink.committed() == set() and not (out / "results").exists()


def test_an_output_resumed_across_a_change_of_columns_reads_as_one_table_in_every_reader(outputs, tmp_path):
    """Shards committed by a raysweep before the results had `completion`, `score_norm`, ... (unwidened,
    polars fails and DuckDB misses the new columns once a resume adds files that have them):
    the resume gives the older files the columns they lack, as nulls, and every reader reads one table."""
    import shutil

    from cluster.contracts.results_schema import RESULT_SCHEMA

    out = tmp_path / "resumed"
    shutil.copytree(outputs["mixed"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["results_columns"]  # as an earlier raysweep wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    with ResultSink(str(out), load_spec(QUICKSTART)) as sink:
        assert sink.widened == 4
        newer = _shard("tiny", "arith", 2)  # a shard as this raysweep writes it: every column
        for field in RESULT_SCHEMA:
            if field.name not in newer.column_names:
                newer = newer.append_column(field, pa.array([0] * ROWS, field.type) if field.name == "completion"
                                            else pa.nulls(ROWS, field.type))
        sink.plan(sorted({*(sid for sid in manifest["shards"] if sid.startswith("tiny/arith/")), "tiny/arith/00002"}))
        sink.commit("tiny/arith/00002", "tiny", "arith", 2, newer.select(RESULT_SCHEMA.names), attempts=1)
    with ResultSink(str(out), load_spec(QUICKSTART)) as sink:
        assert sink.widened == 0  # recorded: not looked at again
    files = sorted((out / "results").rglob("*.parquet"))
    assert all(pq.read_schema(f).names[:len(RESULT_SCHEMA)] == RESULT_SCHEMA.names for f in files[:4])
    for name, read in READERS.items():
        table = read(str(out / "results"))
        assert table.num_rows == 5 * ROWS and "completion" in table.column_names, name


def test_a_committed_file_gone_is_one_line_when_the_columns_are_checked(outputs, tmp_path):
    import shutil

    out = tmp_path / "gone"
    shutil.copytree(outputs["mixed"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["results_columns"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    gone = sorted(e["file"] for e in manifest["shards"].values())[0]
    (out / gone).unlink()
    with pytest.raises(SinkError, match=f"{gone}, a committed shard's results, cannot be read: .*--new-run"):
        ResultSink(str(out), load_spec(QUICKSTART))
