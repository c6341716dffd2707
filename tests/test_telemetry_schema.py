"""The telemetry tables follow cluster/contracts/telemetry_schema.py: a quickstart sweep's tables have exactly
its columns and types, an unknown key is refused by name, and every key the actors' code writes is in it."""

import ast

import pyarrow.parquet as pq
import pytest

from cluster.contracts.telemetry_schema import FIRST_TOKENS, SCHEMAS
from cluster.inputs.spec_file import load_spec
from cluster.store.sink import ResultSink
from tests.conftest import QUICKSTART, ROOT, lean_quickstart

# keys of the actor's shard dict the driver takes out before the row is written (cluster/schedule/run.py
# _add_shard_telemetry, _first_token): they become other tables' rows, not columns
POPPED = {"engine_starts", "gpu_samples", "switches", "engine_start_index", "first_token_at"}

# (file or folder, function) -> the table its telemetry dict literals, `row["key"] = ...` and `dict(x, key=...)` feed
SOURCES = {
    ("actors/evaluator.py", "_start_engine"): "actors",
    ("actors/vllm_engine.py", "startup"): "actors",
    ("actors/hf_engine.py", "startup"): "actors",
    ("actors/fake_engine.py", "startup"): "actors",
    ("actors/evaluator.py", "_run"): "shards",
    ("actors/telemetry.py", "aggregates"): "shards",
    ("actors/telemetry.py", "read"): "gpu",
    ("actors/evaluator.py", "switch"): "switches",
    ("actors/pool_replica.py", "run_shard"): "shards",
    ("cluster/schedule", "on_attempt_failed"): "shards",
    ("cluster/schedule", "_first_token"): FIRST_TOKENS,
}


def _function(path: str, function: str) -> ast.AST:
    """The function `function` in the file `path`, or in any file under the folder `path` (the driver's
    code moves between cluster/schedule/ modules)."""
    files = sorted((ROOT / path).glob("*.py")) if (ROOT / path).is_dir() else [ROOT / path]
    found = [n for f in files for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    assert found, f"{path}: no function {function} (moved? update SOURCES)"
    return found[0]


def _keys(path: str, function: str) -> set[str]:
    found = [_function(path, function)]
    keys = set()
    for node in ast.walk(found[0]):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            keys.add(node.slice.value)
    return keys - POPPED


def _dict_call_keywords(path: str, function: str) -> set[str]:
    """Keys added by `dict(row, key=...)` in the function (the gpu samples' identity, a switch's served_by)."""
    fn = _function(path, function)
    return {kw.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "dict"
            for kw in n.keywords if kw.arg}


def test_every_key_the_actors_write_is_in_the_schema():
    for (path, function), table in SOURCES.items():
        keys = _keys(path, function)
        assert keys, f"{path} {function}: no telemetry keys found"
        missing = keys - set(SCHEMAS[table].names)
        assert not missing, f"{path} {function}: keys {sorted(missing)} are not in telemetry/{table}'s schema"
    gpu_identity = _dict_call_keywords("actors/evaluator.py", "_run")  # dict(sample, actor_id=..., ...)
    assert gpu_identity and gpu_identity <= set(SCHEMAS["gpu"].names)
    switch_keys = _dict_call_keywords("actors/pool_replica.py", "run_shard")  # dict(admission.switch, served_by=...)
    assert switch_keys and switch_keys <= set(SCHEMAS["switches"].names)
    driver_switch = _dict_call_keywords("cluster/schedule", "_add_shard_telemetry")  # sweep_model
    assert driver_switch and driver_switch <= set(SCHEMAS["switches"].names)


def test_an_unknown_key_is_refused_naming_the_table_and_the_key(tmp_path):
    with ResultSink(str(tmp_path / "out"), load_spec(QUICKSTART)) as sink:
        with pytest.raises(ValueError, match=r"telemetry/shards.*'no_such_column'"):
            sink.add_telemetry("shards", {"shard_id": "s0", "no_such_column": 1})
        with pytest.raises(ValueError, match=r"telemetry/gpu.*'wall_s'"):
            sink.add_telemetry("gpu", {"time": 1.0, "wall_s": 2.0})


def test_a_short_row_gets_every_schema_column_typed(tmp_path):
    with ResultSink(str(tmp_path / "out"), load_spec(QUICKSTART)) as sink:
        sink.add_telemetry("shards", {"shard_id": "s0", "attempt": 1, "error": "actor died"})
        sink.finish()
    assert pq.read_schema(tmp_path / "out" / "telemetry" / "shards.parquet").remove_metadata() == SCHEMAS["shards"]


@pytest.mark.slow
def test_a_quickstart_sweeps_telemetry_has_exactly_the_schemas_columns_and_types(engine_host, ray_local, tmp_path):
    from cluster.schedule.run import run_sweep

    out = tmp_path / "out"
    run_sweep(load_spec(lean_quickstart(tmp_path)), output=str(out), engine_host=engine_host, log=lambda line: None)
    written = {p.stem for p in (out / "telemetry").glob("*.parquet")}
    assert {"shards", "actors"} <= written and written <= {"shards", "actors", "gpu", "switches"}
    for name in written:
        assert pq.read_schema(out / "telemetry" / f"{name}.parquet").remove_metadata() == SCHEMAS[name], name
