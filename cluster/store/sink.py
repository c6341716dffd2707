"""The sweep's output (docs/design.md, Output; Exactly once and resume): `ResultSink`, the one object the
driver writes it through. It holds the output locked and keeps the summary; the work is the store's modules':

- cluster/store/output_files.py: opening the location, its lock, writes by rename, the results layout;
- cluster/store/manifest.py: the manifest and its journal, shard states, the resume checks;
- cluster/store/telemetry_store.py: telemetry parts, their flush and the tables `finish` folds them into.

A shard is committed by writing its Parquet file under a temporary name, renaming it into place, then
recording it in the manifest. The summary is accumulated as shards are committed (a few numbers per model x
task), and shards that an earlier run committed are read back one at a time, only the columns it needs: the
driver's memory does not grow with the number of results.

Older results are widened on opening: result files an earlier raysweep committed with fewer columns (an output
resumed across a change of the results' schema, cluster/contracts/results_schema.py) get the missing columns as
nulls, in RESULT_SCHEMA's order. polars and DuckDB read a folder with the first file's schema and fail on (or
miss) columns only later files have.
"""

from __future__ import annotations

import functools
from collections import Counter

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.results_schema import RESULT_SCHEMA
from cluster.contracts.shard import ShardState
from cluster.contracts.spec import SweepSpec
from cluster.score.summary import COLUMNS as SUMMARY_COLUMNS
from cluster.score.summary import SummaryAccumulator
from cluster.store.integrity import check_committed, checksum, table_bytes
from cluster.store.manifest import (PLANNED, SUMMARIZED, ManifestWriter, discard_earlier_run, is_committed, load_manifest,
                                    now, refuse_foreign)
from cluster.store.output_files import (OutputWriteError, SinkError, join, lock, open_output, plain_strings,
                                        remove_leftover_tmp, remove_made, result_file, unlock, write_bytes_renamed,
                                        write_table)
from cluster.store.telemetry_store import DURABLE_TELEMETRY, TelemetryStore


def _writes(method):
    """A write to the output that fails with an OSError (the disk full, the folder made read-only) raises
    OutputWriteError naming the output and the cause: one line at the process's edge, exit 1."""
    @functools.wraps(method)
    def write(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            raise OutputWriteError(f"output {self.output}: writing failed: {e.strerror or e}; what was committed "
                                   "before is kept: fix the cause and run the same command again") from None
    return write


class ResultSink:
    """Open with `with ResultSink(...) as sink:`; the output stays locked against other sweeps until exit."""

    def __init__(self, output: str, spec: SweepSpec, new_run: bool = False, data_hashes: dict | None = None):
        """`data_hashes`: per task {"path", "hash"} of its data file (cluster/inputs/data.py), checked against what
        the output's earlier run recorded: results planned from other data are never mixed in."""
        self.output, self.spec, self.data_hashes = output, spec, data_hashes or {}
        self._writer = None
        self.fs, self.root, self._made = open_output(output)
        self._writer = ManifestWriter(self.fs, self.root)
        self._lock = lock(self.fs, self.root, output)
        try:
            refuse_foreign(self.fs, self.root, output)
            remove_leftover_tmp(self.fs, self.root)  # a dead run's half-written files, never committed
            if new_run:
                discard_earlier_run(self.fs, self.root)
            self.manifest = load_manifest(self.fs, self.root, output, spec, self.data_hashes)
            self.widened, save = widen_older_results(self.fs, self.root, output, self.manifest)  # files rewritten
            if save:
                self._save_manifest()
            check_committed(self.fs, self.root, output, self.manifest)  # each file is what was committed
        except BaseException:
            self.close()
            raise
        self._telemetry = TelemetryStore(self.fs, self.root)
        self._summary = SummaryAccumulator({t.name: t.pass_at for t in spec.tasks if t.pass_at})
        self._summarized: set[str] = set()  # shards whose rows are in self._summary

    def __enter__(self) -> "ResultSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._lock is not None:
            unlock(self._lock, self.root)
            self._lock = None
        remove_made(self._made)  # the folders it made for the output, where nothing was written in them

    @property
    def _journal(self):
        """The append handle of manifest.journal (local outputs), None until a shard is recorded."""
        return self._writer.journal

    @property
    def set_aside(self) -> list[str]:
        """Earlier telemetry tables that could not be read (torn, replaced), renamed `.unreadable-<time>`."""
        return self._telemetry.set_aside

    @property
    def gpu_samples(self) -> int:
        """NVML readings written by this run."""
        return self._telemetry.gpu_samples

    # -- state -------------------------------------------------------------------------------------
    def committed(self) -> set[str]:
        return {sid for sid, s in self.manifest["shards"].items() if s["state"] == ShardState.COMMITTED}

    def nothing_left(self, pairs: set[tuple[str, str]]) -> bool:
        """Whether an earlier run committed every shard of the sweep's (model, task) `pairs`
        (cluster/plan/plan_source.py planned_pairs): each pair's plan recorded (`plan` records a plan's shards
        together, and how many it has) with that many entries, and every shard recorded committed. A shard's id is
        stable for the same spec and data, which the resume checks held, so planning again would find nothing to
        run. An entry the plan lacks (a hand-made one) makes the count differ: the pair is planned again, and `plan`
        refuses the entry."""
        shards, planned = self.manifest["shards"], self.manifest.get(PLANNED, {})
        entries = Counter(sid.rpartition("/")[0] for sid in shards)  # "<model>/<task>" of "<model>/<task>/<index>"
        return all(entries[f"{m}/{t}"] and planned.get(f"{m}/{t}") == entries[f"{m}/{t}"] for m, t in pairs) and \
            all(map(is_committed, shards.values()))

    def written_summary(self) -> pa.Table | None:
        """summary.parquet as the last `finish` wrote it, where it was made from every shard committed now; None
        where there is none, it cannot be read (torn, replaced), or it is older than the last commits (or from before
        the manifest counted them): a summary made again replaces it."""
        path = join(self.root, "summary.parquet")
        if self.manifest.get(SUMMARIZED) != len(self.committed()) or \
                self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        try:
            with self.fs.open_input_file(path) as f:
                return pq.read_table(f)
        except (OSError, pa.ArrowInvalid):
            return None

    def failed(self) -> dict[str, dict]:
        """Shards that fail the sweep, each entry with its `errors`: those that failed (none of their rows is
        committed; a re-run tries them again), and committed ones whose error rows are more than their task's
        fail_on_error allows (cluster/schedule/bisection.py; they stay so: their spec and data cannot change)."""
        return {sid: s for sid, s in self.manifest["shards"].items() if s["state"] == ShardState.FAILED or "errors" in s}

    @_writes
    def plan(self, shard_ids: list[str]) -> None:
        """A (model, task)'s plan recorded, all its shards together. The same spec and data plan the same shards:
        an entry of that model's task the plan does not have is another plan's (a hand-made entry, or a planner
        that cut otherwise), whose rows would be counted beside this plan's, and is refused."""
        planned = set(shard_ids)
        for prefix in {sid.rpartition("/")[0] + "/" for sid in shard_ids}:
            foreign = sorted(sid for sid in self.manifest["shards"] if sid.startswith(prefix) and sid not in planned)
            if foreign:
                raise SinkError(f"output {self.output}: manifest: shard {foreign[0]} is not one of the "
                                f"{len(shard_ids)} shard(s) this spec and data plan for {prefix[:-1]}; restore the "
                                "manifest, or --new-run to start the output again")
        for prefix, count in Counter(sid.rpartition("/")[0] for sid in shard_ids).items():
            self.manifest.setdefault(PLANNED, {})[prefix] = count
        for sid in shard_ids:
            self.manifest["shards"].setdefault(sid, {"state": ShardState.PENDING.value})
            if self.manifest["shards"][sid]["state"] == ShardState.FAILED:  # a new run tries failed shards again
                self.manifest["shards"][sid] = {"state": ShardState.PENDING.value}
        self._save_manifest()

    # -- writes ------------------------------------------------------------------------------------
    @_writes
    def commit(self, shard_id: str, model: str, task: str, index: int, table: pa.Table, attempts: int,
               extra: dict | None = None) -> None:
        """`extra`: more of the manifest entry; a bisected shard's `row_errors` ({sample id: error} of its rows
        that failed alone) and, where they are more than its task allows, `errors` (see `failed`)."""
        rel = result_file(model, task, index)
        table = plain_strings(table, ("model", "task"))
        data = table_bytes(table)
        write_bytes_renamed(self.fs, join(self.root, rel), data)  # a reader never sees half a file
        self._writer.record(self.manifest, shard_id, {"state": ShardState.COMMITTED.value, "file": rel,
                                                      "rows": table.num_rows, "checksum": checksum(data),
                                                      "attempts": attempts, **(extra or {})})
        self._summary.add(table)
        self._summarized.add(shard_id)

    @_writes
    def fail(self, shard_id: str, errors: list[str]) -> None:
        self._writer.record(self.manifest, shard_id, {"state": ShardState.FAILED.value, "attempts": len(errors),
                                                      "errors": errors})

    def add_run(self, record: dict) -> None:
        """One run of the sweep command: when its driver started, and Ray start, planning, first and last
        result in seconds from then (cluster/contracts/timing.py); saved with the manifest."""
        self.manifest.setdefault("runs", []).append(record)

    def add_telemetry(self, table: str, row: dict) -> None:
        """A row of telemetry/<table> (or a FIRST_TOKENS update); ValueError for a key not in its schema."""
        self._telemetry.add(table, row)

    @_writes
    def flush_telemetry(self, tables: tuple[str, ...] = DURABLE_TELEMETRY) -> None:
        """Put the rows added so far to `tables` on disk now (cluster/store/telemetry_store.py)."""
        self._telemetry.flush(tables)

    @_writes
    def summary(self) -> pa.Table:
        """Telemetry written (appended to earlier runs', with the parts an earlier run left when it died), and
        the summary over every committed shard, this run's and earlier ones'. `finish` writes it."""
        self._telemetry.finish()
        for sid in sorted(self.committed() - self._summarized):  # committed by an earlier run
            with self.fs.open_input_file(join(self.root, self.manifest["shards"][sid]["file"])) as f:
                shard = pq.ParquetFile(f)  # an older output's files lack the newer columns: those read as null
                self._summary.add(shard.read(columns=[c for c in SUMMARY_COLUMNS if c in shard.schema_arrow.names]))
            self._summarized.add(sid)
        return self._summary.table()

    @_writes
    def finish(self, summary: pa.Table | None = None) -> pa.Table:
        """The summary written (`summary()`'s, or that table as the run completed it: lm-eval's metrics) and the
        run's end recorded."""
        summary = self.summary() if summary is None else summary
        write_table(self.fs, join(self.root, "summary.parquet"), summary)  # by rename: a reader never sees half
        self.manifest[SUMMARIZED] = len(self.committed())
        self.manifest["finished_at"] = now()
        self._save_manifest()
        return summary

    def committed_rows(self, model: str, task: str, columns: list[str]) -> pa.Table | None:
        """`columns` of every committed row of one model's task; None while any of its shards is not committed."""
        entries = [s for sid, s in self.manifest["shards"].items() if sid.startswith(f"{model}/{task}/")]
        if not entries or any(s["state"] != ShardState.COMMITTED for s in entries):
            return None
        tables = []
        for s in entries:
            with self.fs.open_input_file(join(self.root, s["file"])) as f:
                tables.append(pq.read_table(f, columns=columns))
        return pa.concat_tables(tables)

    @_writes
    def write_text(self, relative: str, body: str) -> None:
        """A text file under the output, by rename."""
        write_bytes_renamed(self.fs, join(self.root, relative), body.encode())

    @_writes
    def write_parquet(self, relative: str, table: pa.Table) -> None:
        """A Parquet file under the output, by rename."""
        write_table(self.fs, join(self.root, relative), table)

    def _save_manifest(self) -> None:
        self._writer.save(self.manifest)


def widen_older_results(fs: pafs.FileSystem, root: str, output: str, manifest: dict) -> tuple[int, bool]:
    """Looked at only when the manifest records another column list than RESULT_SCHEMA's; records the
    schema's. Returns the files rewritten, and whether the manifest needs saving (it has committed shards)."""
    columns = list(RESULT_SCHEMA.names)
    if manifest.get("results_columns") == columns:
        return 0, False
    widened, committed = 0, [e for e in manifest["shards"].values() if is_committed(e)]
    for entry in committed:
        if not entry.get("file"):
            continue
        try:
            with fs.open_input_file(join(root, entry["file"])) as f:
                missing = [name for name in columns if name not in pq.read_schema(f).names]
                table = pq.read_table(f) if missing else None
        except (OSError, pa.ArrowInvalid) as e:
            raise SinkError(f"output {output}: {entry['file']}, a committed shard's results, cannot be "
                            f"read: {str(e).splitlines()[0] if str(e) else type(e).__name__}; restore it, or "
                            "--new-run to discard the output's results") from None
        if not missing:
            continue
        for name in missing:
            table = table.append_column(RESULT_SCHEMA.field(name), pa.nulls(table.num_rows, RESULT_SCHEMA.field(name).type))
        extra = [name for name in table.column_names if name not in columns]  # kept, after the schema's
        data = table_bytes(table.select([n for n in columns if n in table.column_names] + extra))
        write_bytes_renamed(fs, join(root, entry["file"]), data)
        if "checksum" in entry:  # the file is the committed rows, widened: its new bytes are what is checked
            entry["checksum"] = checksum(data)
        widened += 1
    manifest["results_columns"] = columns
    return widened, bool(committed)
