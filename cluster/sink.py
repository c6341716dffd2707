"""The sweep's output (DESIGN §5, §6): result shards committed atomically, the manifest, telemetry, summary.

A shard is committed by writing its Parquet file under a temporary name, renaming it into place, then
recording it in manifest.json (itself replaced atomically). Re-running the same spec into the same output
skips committed shards; a different spec into it is refused. Works on any pyarrow filesystem URI.
"""

from __future__ import annotations

import json
import math
import os
import platform
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.spec import SweepSpec

SUMMARY_SCHEMA = pa.schema([
    ("model", pa.string()), ("task", pa.string()), ("n", pa.int64()), ("n_scored", pa.int64()),
    ("score", pa.float64()), ("stderr", pa.float64()), ("n_ok", pa.int64()), ("n_truncated", pa.int64()),
    ("n_skipped", pa.int64()), ("n_error", pa.int64()), ("structured_valid_rate", pa.float64()),
    ("output_tokens", pa.int64()),
])


class SinkError(RuntimeError):
    """The output location cannot be used; the message names it."""


class ResultSink:
    """Open with `with ResultSink(...) as sink:`; the output stays locked against other sweeps until exit."""

    def __init__(self, output: str, spec: SweepSpec, new_run: bool = False):
        self.output, self.spec = output, spec
        self.fs, self.root = _filesystem(output)
        try:
            self.fs.create_dir(self.root, recursive=True)
            self._write_bytes(self._path(".write-test"), b"")
            self.fs.delete_file(self._path(".write-test"))
        except OSError as e:
            raise SinkError(f"output {output}: not writable: {e}") from None
        self._lock = _lock(self.fs, self.root, output)
        try:
            if new_run:
                self._discard_earlier_run()
            self.manifest = self._load_manifest()
        except BaseException:
            self.close()
            raise
        self._telemetry: dict[str, list[dict]] = {"shards": [], "actors": [], "gpu": []}
        self.gpu_samples = 0  # NVML readings written by this run

    def __enter__(self) -> "ResultSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None

    def _discard_earlier_run(self) -> None:
        for rel in ("results", "telemetry"):
            if self.fs.get_file_info(self._path(rel)).type == pafs.FileType.Directory:
                self.fs.delete_dir(self._path(rel))
        for rel in ("manifest.json", "summary.parquet"):
            if self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File:
                self.fs.delete_file(self._path(rel))

    # -- state -------------------------------------------------------------------------------------
    def committed(self) -> set[str]:
        return {sid for sid, s in self.manifest["shards"].items() if s["state"] == "committed"}

    def failed(self) -> dict[str, dict]:
        return {sid: s for sid, s in self.manifest["shards"].items() if s["state"] == "failed"}

    def plan(self, shard_ids: list[str]) -> None:
        for sid in shard_ids:
            self.manifest["shards"].setdefault(sid, {"state": "pending"})
            if self.manifest["shards"][sid]["state"] == "failed":  # a new run tries failed shards again
                self.manifest["shards"][sid] = {"state": "pending"}
        self._save_manifest()

    # -- writes ------------------------------------------------------------------------------------
    def commit(self, shard_id: str, model: str, task: str, index: int, table: pa.Table, attempts: int) -> None:
        rel = f"results/model={model}/task={task}/shard-{index:05d}.parquet"
        final = self._path(rel)
        tmp = self._path(f"results/model={model}/task={task}/.shard-{index:05d}.{uuid.uuid4().hex[:8]}.tmp")
        self.fs.create_dir(os.path.dirname(final), recursive=True)
        with self.fs.open_output_stream(tmp) as f:
            pq.write_table(table, f)
        self.fs.move(tmp, final)
        self.manifest["shards"][shard_id] = {"state": "committed", "file": rel, "rows": table.num_rows,
                                             "attempts": attempts}
        self._save_manifest()

    def fail(self, shard_id: str, errors: list[str]) -> None:
        self.manifest["shards"][shard_id] = {"state": "failed", "attempts": len(errors), "errors": errors}
        self._save_manifest()

    def add_telemetry(self, table: str, row: dict) -> None:
        self._telemetry[table].append(row)
        if table == "gpu":
            self.gpu_samples += 1

    def finish(self) -> pa.Table:
        """Write telemetry (appended to earlier runs') and the summary over every committed shard."""
        for name, rows in self._telemetry.items():
            if rows:
                self._append_table(f"telemetry/{name}.parquet", pa.Table.from_pylist(rows))
            rows.clear()
        summary = summarize(self.read_results())
        with self.fs.open_output_stream(self._path("summary.parquet")) as f:
            pq.write_table(summary, f)
        self.manifest["finished_at"] = _now()
        self._save_manifest()
        return summary

    def read_results(self) -> pa.Table | None:
        tables = []
        for sid in sorted(self.committed()):
            with self.fs.open_input_file(self._path(self.manifest["shards"][sid]["file"])) as f:
                tables.append(pq.read_table(f))
        return pa.concat_tables(tables, promote_options="default") if tables else None

    # -- internals ---------------------------------------------------------------------------------
    def _path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def _load_manifest(self) -> dict:
        digest = self.spec.digest()
        info = self.fs.get_file_info(self._path("manifest.json"))
        if info.type == pafs.FileType.NotFound:
            manifest = {"sweep": self.spec.name, "spec_hash": digest, "created_at": _now(), "versions": _versions(),
                        "shards": {}}
            return manifest
        with self.fs.open_input_stream(self._path("manifest.json")) as f:
            manifest = json.loads(f.read())
        if manifest.get("spec_hash") != digest:
            raise SinkError(f"output {self.output} holds results of another spec (hash {manifest.get('spec_hash')}, "
                            f"this one is {digest}); use a new output, or --new-run to discard them")
        return manifest

    def _save_manifest(self) -> None:
        tmp = self._path(f".manifest.{uuid.uuid4().hex[:8]}.tmp")
        self._write_bytes(tmp, json.dumps(self.manifest, indent=1, sort_keys=True).encode())
        self.fs.move(tmp, self._path("manifest.json"))

    def _write_bytes(self, path: str, data: bytes) -> None:
        with self.fs.open_output_stream(path) as f:
            f.write(data)

    def _append_table(self, rel: str, table: pa.Table) -> None:
        path = self._path(rel)
        self.fs.create_dir(os.path.dirname(path), recursive=True)
        if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
            with self.fs.open_input_file(path) as f:
                table = pa.concat_tables([pq.read_table(f), table], promote_options="permissive")
        tmp = path + f".{uuid.uuid4().hex[:8]}.tmp"
        with self.fs.open_output_stream(tmp) as f:
            pq.write_table(table, f)
        self.fs.move(tmp, path)


def summarize(results: pa.Table | None) -> pa.Table:
    """Per model x task: sample counts by status, mean score and its standard error (sample std / sqrt n)."""
    if results is None or results.num_rows == 0:
        return SUMMARY_SCHEMA.empty_table()
    rows = []
    keys = sorted(set(zip(results["model"].to_pylist(), results["task"].to_pylist())))
    for model, task in keys:
        part = results.filter(pc.and_(pc.equal(results["model"], model), pc.equal(results["task"], task)))
        scores = [s for s in part["score"].to_pylist() if s is not None]
        status = part["status"].to_pylist()
        valid = [v for v in part["structured_valid"].to_pylist() if v is not None]
        mean = sum(scores) / len(scores) if scores else None
        stderr = (math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1) / len(scores))
                  if len(scores) > 1 else None)
        rows.append({"model": model, "task": task, "n": part.num_rows, "n_scored": len(scores), "score": mean,
                     "stderr": stderr, **{f"n_{s}": status.count(s) for s in ("ok", "truncated", "skipped", "error")},
                     "structured_valid_rate": sum(valid) / len(valid) if valid else None,
                     "output_tokens": int(pc.sum(part["output_tokens"]).as_py() or 0)})
    return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)


def _lock(fs: pafs.FileSystem, root: str, output: str):
    """An exclusive lock on a local output (flock: the OS drops it when the holder dies, even by
    kill -9). Object stores have no such lock; there two sweeps into one output are not prevented."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return None
    import fcntl
    import socket

    handle = open(os.path.join(root, ".lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise SinkError(f"output {output} is in use by another sweep ({holder}); wait for it or use another output") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
    handle.flush()
    return handle


def _filesystem(output: str) -> tuple[pafs.FileSystem, str]:
    if "://" in output:
        return pafs.FileSystem.from_uri(output)
    return pafs.LocalFileSystem(), os.path.abspath(output)


def _versions() -> dict:
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for dist in ("raysweep", "ray", "pyarrow", "transformers", "torch", "xgrammar", "vllm"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return versions


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
