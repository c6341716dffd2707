"""The sweep's output (DESIGN §5, §6): result shards committed atomically, the manifest, telemetry, summary.

A shard is committed by writing its Parquet file under a temporary name, renaming it into place, then
recording it in the manifest. On a local disk the record is one line appended to manifest.journal
(flushed; a torn last line from a crash is ignored), and manifest.json, replaced atomically, takes the
journal in when the plan is recorded and when the sweep finishes: a commit costs the same at the
4,000th shard as at the first. Object stores cannot append, so there manifest.json is replaced on every
commit. `read_manifest` merges both. Re-running the same spec into the same output skips committed
shards; a different spec into it is refused. Works on any pyarrow filesystem URI.

Results lie in results/<model>/<task>/shard-NNNNN.parquet with model and task as string columns in the
files, not as hive key=value folders (see `result_file`): pyarrow, pandas, polars, DuckDB and Ray Data
then read the folder as one table whatever the names.

The summary is accumulated as shards are committed (a few numbers per model x task), and shards that
an earlier run committed are read back one at a time, only the columns it needs: the driver's memory
does not grow with the number of results.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.errors import RaysweepError
from cluster.contracts.results_schema import RESULT_SCHEMA
from cluster.contracts.spec import SweepSpec
from cluster.score.summary import COLUMNS as SUMMARY_COLUMNS
from cluster.score.summary import SummaryAccumulator, summarize  # noqa: F401 (tests read summarize from here)

# what `reproducible: true` runs (actors/vllm_engine.py REPRODUCIBLE_ARGS; the CPU engine runs one row at a
# time), kept in the manifest: a resume adds to reproducible results only under the same setting. It changes
# with REPRODUCIBLE_ARGS.
REPRODUCIBLE_SETTING = ("vLLM batch-invariant mode with TRITON_ATTN, no prefix caching, no chunked prefill, CUDA "
                        "graphs and torch.compile on")

JOURNAL = "manifest.journal"
LOCK = ".lock"  # held (flock) while a sweep writes the output; removed when it is done
PENDING = "telemetry/.pending"  # telemetry parts written as shards commit, folded in by finish()
TELEMETRY = ("shards", "actors", "gpu", "switches")  # the tables under telemetry/ (switches: the pool's sleep/wake)
# updates of telemetry/actors rows already on disk: {actor_id, start_index, first_token_s}, the earliest first
# token seen on that engine start; finish() folds them into their rows (and drops them)
FIRST_TOKENS = "first_token"
# flushed in this order: a shard's row on disk means the engine starts, readings and first tokens before it are
DURABLE_TELEMETRY = (FIRST_TOKENS, "actors", "gpu", "switches", "shards")


class SinkError(RaysweepError, RuntimeError):
    """The output location cannot be used; the message names it."""


class ResultSink:
    """Open with `with ResultSink(...) as sink:`; the output stays locked against other sweeps until exit."""

    def __init__(self, output: str, spec: SweepSpec, new_run: bool = False, data_hashes: dict | None = None):
        """`data_hashes`: per task {"path", "hash"} of its data file (cluster/inputs/data.py), checked against what
        the output's earlier run recorded: results planned from other data are never mixed in."""
        self.output, self.spec, self.data_hashes = output, spec, data_hashes or {}
        self._journal = None  # append handle of manifest.journal (local outputs)
        try:
            self.fs, self.root = _filesystem(output)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid (an unknown scheme) is a ValueError
            raise SinkError(f"output {output}: cannot be opened: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
        try:
            self.fs.create_dir(self.root, recursive=True)
            self._write_bytes(self._path(".write-test"), b"")
            self.fs.delete_file(self._path(".write-test"))
        except OSError as e:
            raise SinkError(f"output {output}: not writable: {e}") from None
        self._lock = _lock(self.fs, self.root, output)
        try:
            self._refuse_foreign()
            if new_run:
                self._discard_earlier_run()
            self.manifest = self._load_manifest()
            self.widened = self._widen_older_results()  # files rewritten with the columns they lacked
        except BaseException:
            self.close()
            raise
        self._telemetry: dict[str, list[dict]] = {name: [] for name in DURABLE_TELEMETRY}
        self.gpu_samples = 0  # NVML readings written by this run
        self._summary = SummaryAccumulator({t.name: t.pass_at for t in spec.tasks if t.pass_at})
        self._summarized: set[str] = set()  # shards whose rows are in self._summary

    def __enter__(self) -> "ResultSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._lock is not None:
            try:
                os.remove(self._path(LOCK))  # removed while still held (see _lock); a clean exit leaves none
            except FileNotFoundError:
                pass
            self._lock.close()  # closing the file releases the flock
            self._lock = None

    def _refuse_foreign(self) -> None:
        """An output with results/, or telemetry/ holding more than a killed run's telemetry/.pending, but no
        manifest.json is not a sweep's (a sweep saves its manifest before its first result): nothing is
        written beside those folders, and `--new-run` deletes nothing there."""
        if self.fs.get_file_info(self._path("manifest.json")).type != pafs.FileType.NotFound:
            return
        for rel in ("results", "telemetry"):
            if self.fs.get_file_info(self._path(rel)).type != pafs.FileType.Directory:
                continue
            entries = self.fs.get_file_info(pafs.FileSelector(self._path(rel)))
            if rel == "results" or any(e.base_name != ".pending" for e in entries):
                raise SinkError(f"output {self.output}: holds {rel}/ but no manifest.json, so it is not a raysweep "
                                "output; nothing was changed there: choose another output")

    def _discard_earlier_run(self) -> None:
        for rel in ("results", "telemetry"):
            if self.fs.get_file_info(self._path(rel)).type == pafs.FileType.Directory:
                self.fs.delete_dir(self._path(rel))
        for rel in ("manifest.json", JOURNAL, "summary.parquet", "report.html"):
            if self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File:
                self.fs.delete_file(self._path(rel))

    # -- state -------------------------------------------------------------------------------------
    def committed(self) -> set[str]:
        return {sid for sid, s in self.manifest["shards"].items() if s["state"] == "committed"}

    def failed(self) -> dict[str, dict]:
        """Shards that fail the sweep, each entry with its `errors`: those that failed (none of their rows is
        committed; a re-run tries them again), and committed ones whose error rows are more than their task's
        fail_on_error allows (cluster/schedule/bisection.py; they stay so: their spec and data cannot change)."""
        return {sid: s for sid, s in self.manifest["shards"].items() if s["state"] == "failed" or "errors" in s}

    def plan(self, shard_ids: list[str]) -> None:
        for sid in shard_ids:
            self.manifest["shards"].setdefault(sid, {"state": "pending"})
            if self.manifest["shards"][sid]["state"] == "failed":  # a new run tries failed shards again
                self.manifest["shards"][sid] = {"state": "pending"}
        self._save_manifest()

    # -- writes ------------------------------------------------------------------------------------
    def commit(self, shard_id: str, model: str, task: str, index: int, table: pa.Table, attempts: int,
               extra: dict | None = None) -> None:
        """`extra`: more of the manifest entry; a bisected shard's `row_errors` ({sample id: error} of its rows
        that failed alone) and, where they are more than its task allows, `errors` (see `failed`)."""
        rel = result_file(model, task, index)
        table = _plain_strings(table, ("model", "task"))
        self._write_results(rel, table)
        self._record(shard_id, {"state": "committed", "file": rel, "rows": table.num_rows, "attempts": attempts,
                                **(extra or {})})
        self._summary.add(table)
        self._summarized.add(shard_id)

    def _write_results(self, rel: str, table: pa.Table) -> None:
        """Written under a temporary name, then renamed: a reader never sees half a file."""
        final = self._path(rel)
        tmp = f"{os.path.dirname(final)}/.{os.path.basename(final)}.{uuid.uuid4().hex[:8]}.tmp"
        self.fs.create_dir(os.path.dirname(final), recursive=True)
        with self.fs.open_output_stream(tmp) as f:
            pq.write_table(table, f)
        self.fs.move(tmp, final)

    def _widen_older_results(self) -> int:
        """Result files an earlier raysweep committed with fewer columns (an output resumed across a change of
        the results' schema) get the missing columns as nulls, in RESULT_SCHEMA's order: polars and DuckDB
        read a folder with the first file's schema and fail on (or miss) columns only later files have.
        Looked at only when the manifest records another column list; returns the files rewritten."""
        columns = list(RESULT_SCHEMA.names)
        if self.manifest.get("results_columns") == columns:
            return 0
        widened, committed = 0, [e for e in self.manifest["shards"].values() if e.get("state") == "committed"]
        for entry in committed:
            if not entry.get("file"):
                continue
            try:
                with self.fs.open_input_file(self._path(entry["file"])) as f:
                    missing = [name for name in columns if name not in pq.read_schema(f).names]
                    table = pq.read_table(f) if missing else None
            except (OSError, pa.ArrowInvalid) as e:
                raise SinkError(f"output {self.output}: {entry['file']}, a committed shard's results, cannot be "
                                f"read: {str(e).splitlines()[0] if str(e) else type(e).__name__}; restore it, or "
                                "--new-run to discard the output's results") from None
            if not missing:
                continue
            for name in missing:
                table = table.append_column(RESULT_SCHEMA.field(name), pa.nulls(table.num_rows, RESULT_SCHEMA.field(name).type))
            extra = [name for name in table.column_names if name not in columns]  # kept, after the schema's
            self._write_results(entry["file"], table.select([n for n in columns if n in table.column_names] + extra))
            widened += 1
        self.manifest["results_columns"] = columns
        if committed:
            self._save_manifest()
        return widened

    def fail(self, shard_id: str, errors: list[str]) -> None:
        self._record(shard_id, {"state": "failed", "attempts": len(errors), "errors": errors})

    def _record(self, shard_id: str, entry: dict) -> None:
        self.manifest["shards"][shard_id] = entry
        if not isinstance(self.fs, pafs.LocalFileSystem):
            self._save_manifest()
            return
        if self._journal is None:
            self._journal = open(self._path(JOURNAL), "a", encoding="utf-8")
            self._journal.write("\n")  # ends a line a killed writer may have torn; empty lines are skipped
        self._journal.write(json.dumps({"shard_id": shard_id, **entry}, sort_keys=True) + "\n")
        self._journal.flush()  # in the OS once written: a killed driver loses nothing it recorded

    def add_run(self, record: dict) -> None:
        """One run of the sweep command: when its driver started, and Ray start, planning, first and last
        result in seconds from then (cluster/contracts/timing.py); saved with the manifest."""
        self.manifest.setdefault("runs", []).append(record)

    def add_telemetry(self, table: str, row: dict) -> None:
        self._telemetry[table].append(row)
        if table == "gpu":
            self.gpu_samples += 1

    def flush_telemetry(self, tables: tuple[str, ...] = DURABLE_TELEMETRY) -> None:
        """Put the rows added so far to `tables` on disk now, as parts under telemetry/.pending/ that
        finish() (this run's, or a later run's after a crash) folds into telemetry/<table>.parquet. An
        `actors` row goes as its engine starts; its first_token_s, known later, as a FIRST_TOKENS update."""
        for name in tables:
            rows = self._telemetry[name]
            if rows:
                part = self._path(f"{PENDING}/{name}-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet")
                self.fs.create_dir(os.path.dirname(part), recursive=True)
                tmp = part + ".tmp"
                with self.fs.open_output_stream(tmp) as f:
                    pq.write_table(_rows_table(rows), f)
                self.fs.move(tmp, part)
                rows.clear()

    def _take_pending(self, name: str) -> tuple[pa.Table | None, list[str]]:
        """The rows of `name` on disk (parts, this run's or a dead run's) and in memory, and the parts' paths."""
        parts, tables = self._pending_parts(name), []
        for part in parts:
            with self.fs.open_input_file(part) as f:
                tables.append(pq.read_table(f))
        if self._telemetry[name]:
            tables.append(_rows_table(self._telemetry[name]))
            self._telemetry[name].clear()
        return (pa.concat_tables(tables, promote_options="permissive") if tables else None), parts

    def _drop_torn_parts(self) -> None:
        """Parts a killed run was writing (`.tmp`, never moved into place: their rows were in no committed
        shard's telemetry yet, as a shard commits only after its parts are in place)."""
        selector = pafs.FileSelector(self._path(PENDING), allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            if info.base_name.endswith(".tmp"):
                self.fs.delete_file(info.path)

    def _pending_parts(self, name: str) -> list[str]:
        selector = pafs.FileSelector(self._path(PENDING), allow_not_found=True)
        return sorted(i.path for i in self.fs.get_file_info(selector)
                      if i.base_name.startswith(f"{name}-") and i.base_name.endswith(".parquet"))

    def finish(self) -> pa.Table:
        """Write telemetry (appended to earlier runs', with the parts an earlier run left when it died)
        and the summary over every committed shard."""
        first_tokens, update_parts = self._take_pending(FIRST_TOKENS)
        for name in TELEMETRY:
            table, parts = self._take_pending(name)
            if table is not None and name == "actors":
                table = _with_first_tokens(table, first_tokens)
            if table is not None:
                self._append_table(f"telemetry/{name}.parquet", table)
            for part in parts:
                self.fs.delete_file(part)
        for part in update_parts:  # once the rows they update are written
            self.fs.delete_file(part)
        self._drop_torn_parts()
        for sid in sorted(self.committed() - self._summarized):  # committed by an earlier run
            with self.fs.open_input_file(self._path(self.manifest["shards"][sid]["file"])) as f:
                shard = pq.ParquetFile(f)  # an older output's files lack the newer columns: those read as null
                self._summary.add(shard.read(columns=[c for c in SUMMARY_COLUMNS if c in shard.schema_arrow.names]))
            self._summarized.add(sid)
        summary = self._summary.table()
        with self.fs.open_output_stream(self._path("summary.parquet")) as f:
            pq.write_table(summary, f)
        self.manifest["finished_at"] = _now()
        self._save_manifest()
        return summary

    # -- internals ---------------------------------------------------------------------------------
    def _path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def _load_manifest(self) -> dict:
        digest = self.spec.digest()
        info = self.fs.get_file_info(self._path("manifest.json"))
        if info.type == pafs.FileType.NotFound:
            return self._fresh_manifest(digest)
        manifest = read_manifest(self.output)
        made = bool(manifest.get("reproducible"))
        if made != self.spec.reproducible and any(e.get("state") == "committed" for e in manifest["shards"].values()):
            raise SinkError(f"output {self.output} holds results made with reproducible: {str(made).lower()}; this "
                            f"spec says reproducible: {str(self.spec.reproducible).lower()}, and one output never "
                            "mixes the two: use a new output, or --new-run to discard them")
        setting = manifest.get("reproducible_setting")
        if made and self.spec.reproducible and setting != REPRODUCIBLE_SETTING and \
                any(e.get("state") == "committed" for e in manifest["shards"].values()):
            raise SinkError(f"output {self.output} holds reproducible results made with another setting "
                            f"({setting or 'one from before settings were recorded'}); this raysweep runs "
                            f"{REPRODUCIBLE_SETTING}, and one output never mixes the two: use a new output, or "
                            "--new-run to discard them")
        if manifest.get("spec_hash") not in (digest, self.spec.digest(with_placement=True)) and \
                not any(e.get("state") == "committed" for e in manifest["shards"].values()):
            # another spec's run that committed nothing (refused or failed early): nothing to keep apart
            return dict(self._fresh_manifest(digest), runs=manifest.get("runs", []))
        if manifest.get("spec_hash") not in (digest, self.spec.digest(with_placement=True)):
            raise SinkError(f"output {self.output} holds results of another spec (hash {manifest.get('spec_hash')}, "
                            f"this one is {digest}); use a new output, or --new-run to discard them")
        old = next((e["file"] for e in manifest["shards"].values()
                    if e.get("state") == "committed" and "/model=" in f"/{e.get('file', '')}"), None)
        if old is not None:
            raise SinkError(f"output {self.output} holds results in an earlier raysweep's layout ({old}); this one "
                            "writes results/<model>/<task>/ and cannot add to them: use a new output, or --new-run "
                            "to discard them")
        recorded = manifest.setdefault("data", {})
        committed = {sid.split("/")[1] for sid, entry in manifest["shards"].items() if entry.get("state") == "committed"}
        for task, now in self.data_hashes.items():
            before = recorded.get(task)
            if before is not None and before["hash"] != now["hash"] and task in committed:
                raise SinkError(f"output {self.output}: the data of task {task} ({now['path']}) changed since the "
                                f"results there were made from it; restore it, or --new-run to discard them")
            # nothing committed from the old data (or an output from before data was recorded): the new holds
            recorded[task] = now
        manifest["spec_hash"] = digest
        manifest.update(reproducible=self.spec.reproducible, spec_source=self._spec_source(),
                        reproducible_setting=REPRODUCIBLE_SETTING if self.spec.reproducible else None)
        return manifest

    def _fresh_manifest(self, digest: str) -> dict:
        return {"sweep": self.spec.name, "spec_hash": digest, "created_at": _now(), "versions": _versions(),
                "shards": {}, "data": self.data_hashes, "reproducible": self.spec.reproducible,
                "reproducible_setting": REPRODUCIBLE_SETTING if self.spec.reproducible else None,
                "results_columns": list(RESULT_SCHEMA.names), "spec_source": self._spec_source()}

    def _spec_source(self) -> str | None:
        """The spec file's absolute path (`raysweep verify` reads it again), where it came from a file."""
        return os.path.abspath(self.spec.source) if os.path.isfile(self.spec.source) else None

    def _save_manifest(self) -> None:
        """Replace manifest.json with the whole state; the journal's lines are in it now, so it is emptied
        (a crash between the two leaves lines that repeat what manifest.json says: harmless)."""
        tmp = self._path(f".manifest.{uuid.uuid4().hex[:8]}.tmp")
        self._write_bytes(tmp, json.dumps(self.manifest, indent=1, sort_keys=True).encode())
        self.fs.move(tmp, self._path("manifest.json"))
        if isinstance(self.fs, pafs.LocalFileSystem):
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            if os.path.exists(self._path(JOURNAL)):
                os.remove(self._path(JOURNAL))

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


def result_file(model: str, task: str, index: int) -> str:
    """A shard's results file, relative to the output: results/<model>/<task>/shard-NNNNN.parquet.

    Plain folder names, not hive's model=M/task=T: model and task are string columns in every file, and a
    key=value folder makes pyarrow, pandas, polars and DuckDB infer the column again from the path, as an
    integer for a name like "13" (a type clash with the file's string, or "011" read as 11). With no
    key=value in the path, every reader takes both columns from the files, as strings."""
    for what, name in (("model", model), ("task", task)):
        if not name or "/" in name or "=" in name:  # the spec's name rule keeps them out; the layout needs it
            raise ValueError(f"{what} name {name!r}: a results folder name cannot be empty or hold '/' or '='")
    return f"results/{model}/{task}/shard-{index:05d}.parquet"


def _plain_strings(table: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    """The named columns as plain strings: a dictionary-encoded column reads back as a pandas category and
    a polars Categorical, not as text."""
    for name in columns:
        if name in table.column_names and table.schema.field(name).type != pa.string():
            table = table.set_column(table.schema.get_field_index(name), name, table[name].cast(pa.string()))
    return table


def _rows_table(rows: list[dict]) -> pa.Table:
    """Telemetry rows as a table with every column any row has (pyarrow would take the first row's
    columns only: a failed attempt's short row before a full one would drop the full one's figures)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows])


def _with_first_tokens(actors: pa.Table, updates: pa.Table | None) -> pa.Table:
    """telemetry/actors rows with their first_token_s: the earliest of the FIRST_TOKENS updates for each
    (actor_id, start_index)."""
    if updates is None:
        return actors
    earliest: dict[tuple, float] = {}
    for u in updates.to_pylist():
        key = (u["actor_id"], u["start_index"])
        earliest[key] = min(earliest.get(key, u["first_token_s"]), u["first_token_s"])
    rows = actors.to_pylist()
    for row in rows:
        found = [t for t in (row.get("first_token_s"), earliest.get((row.get("actor_id"), row.get("start_index"))))
                 if t is not None]
        row["first_token_s"] = min(found) if found else None
    return _rows_table(rows)


def read_manifest(output: str) -> dict:
    """The manifest of an output: manifest.json with the commits journaled after it applied in order
    (a torn last line, from a driver killed mid-write, is skipped). Raises FileNotFoundError if absent."""
    fs, root = _filesystem(output)
    base = f"{root.rstrip('/')}"
    with fs.open_input_stream(f"{base}/manifest.json") as f:
        manifest = json.loads(f.read())
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if isinstance(shards, dict) and fs.get_file_info(f"{base}/{JOURNAL}").type == pafs.FileType.File:
        with fs.open_input_stream(f"{base}/{JOURNAL}") as f:
            for line in f.read().decode("utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                shards[entry.pop("shard_id")] = entry
    return manifest


def _lock(fs: pafs.FileSystem, root: str, output: str):
    """An exclusive lock on a local output (flock: the OS drops it when the holder dies, even by
    kill -9). Object stores have no such lock; there two sweeps into one output are not prevented."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return None
    import fcntl
    import socket

    path = os.path.join(root, LOCK)
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise SinkError(f"output {output} is in use by another sweep ({holder}); wait for it or use another "
                            "output") from None
        try:  # the holder before us removes the file as it lets go: a lock on that removed file holds nothing
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        handle.close()
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
