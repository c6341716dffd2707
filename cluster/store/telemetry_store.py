"""Telemetry on disk (docs/design.md, Telemetry): rows added as the sweep runs, flushed as parts under telemetry/.pending/
as shards commit, and folded by `finish` into telemetry/<table>.parquet (appended to earlier runs'). Each
table is built from its schema (cluster/contracts/telemetry_schema.py): a key not in it is refused.

telemetry/actors rows go to disk as their engine starts; each one's first_token_s, known only once a shard
comes back, as a FIRST_TOKENS update that `finish` folds into its row (the earliest per engine start).
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.telemetry_schema import FIRST_TOKENS, check_row, conform, telemetry_table
from cluster.store.output_files import join, read_table, write_table

PENDING = "telemetry/.pending"  # telemetry parts written as shards commit, folded in by finish()
TELEMETRY = ("shards", "actors", "gpu", "switches")  # the tables under telemetry/ (switches: the pool's sleep/wake)
# flushed in this order: a shard's row on disk means the engine starts, readings and first tokens before it are
DURABLE_TELEMETRY = (FIRST_TOKENS, "actors", "gpu", "switches", "shards")


class TelemetryStore:
    """One output's telemetry: `add` rows, `flush` them to parts, `finish` them into the tables."""

    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs, self.root = fs, root
        self.rows: dict[str, list[dict]] = {name: [] for name in DURABLE_TELEMETRY}
        self.gpu_samples = 0  # NVML readings written by this run
        self.set_aside: list[str] = []  # earlier telemetry tables that could not be read, kept beside as is

    def add(self, table: str, row: dict) -> None:
        check_row(table, row)  # a key not in the schema fails here, where it is added
        self.rows[table].append(row)
        if table == "gpu":
            self.gpu_samples += 1

    def flush(self, tables: tuple[str, ...] = DURABLE_TELEMETRY) -> None:
        """Put the rows added so far to `tables` on disk now, as parts under telemetry/.pending/ that
        finish() (this run's, or a later run's after a crash) folds into telemetry/<table>.parquet."""
        for name in tables:
            rows = self.rows[name]
            if rows:
                part = join(self.root, f"{PENDING}/{name}-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet")
                write_table(self.fs, part, telemetry_table(name, rows), tmp=part + ".tmp")
                rows.clear()

    def finish(self) -> None:
        """Every table's parts and rows in memory appended to telemetry/<table>.parquet, first tokens folded
        into telemetry/actors; the parts and any torn part a killed run left are deleted."""
        first_tokens, update_parts = self._take_pending(FIRST_TOKENS)
        for name in TELEMETRY:
            table, parts = self._take_pending(name)
            if table is not None and name == "actors":
                table = _with_first_tokens(table, first_tokens)
            if table is not None:
                self._append(name, table)
            for part in parts:
                self.fs.delete_file(part)
        for part in update_parts:  # once the rows they update are written
            self.fs.delete_file(part)
        self._drop_torn_parts()

    def _take_pending(self, name: str) -> tuple[pa.Table | None, list[str]]:
        """The rows of `name` on disk (parts, this run's or a dead run's) and in memory, and the parts' paths."""
        parts = self._pending_parts(name)
        tables = [self._read_part(name, part) for part in parts]
        if self.rows[name]:
            tables.append(telemetry_table(name, self.rows[name]))
            self.rows[name].clear()
        return (pa.concat_tables(tables, promote_options="permissive") if tables else None), parts

    def _read_part(self, name: str, part: str, gone_ok: bool = False) -> pa.Table | None:
        """A part's rows as the schema has them (a part an older raysweep wrote too); with `gone_ok`, None for a
        part gone since it was listed (a running sweep's `finish` folded it in)."""
        try:
            with self.fs.open_input_file(part) as f:
                return conform(name, pq.read_table(f))
        except FileNotFoundError:
            if gone_ok:
                return None
            raise

    def so_far(self, name: str) -> pa.Table | None:
        """telemetry/<name>.parquet with the parts not folded into it yet (a running or stopped sweep's) after it,
        telemetry/actors with its first tokens: what `finish` would make of them, read without writing anything.
        The table is read before the parts are listed, so rows a running `finish` moves meanwhile are left out,
        never read twice."""
        table = read_table(self.fs, join(self.root, f"telemetry/{name}.parquet"))
        tables = ([] if table is None else [conform(name, table)]) + self._parts_left(name)
        if not tables:
            return None
        table = pa.concat_tables(tables, promote_options="permissive")
        if name == "actors":
            updates = self._parts_left(FIRST_TOKENS)
            table = _with_first_tokens(table, pa.concat_tables(updates, promote_options="permissive") if updates
                                       else None)
        return table

    def _parts_left(self, name: str) -> list[pa.Table]:
        """The parts of `name` there now, each read (one gone since it was listed is left out)."""
        found = (self._read_part(name, part, gone_ok=True) for part in self._pending_parts(name))
        return [table for table in found if table is not None]

    def _append(self, name: str, table: pa.Table) -> None:
        """Appended to the table on disk (an older output's: null-typed where its columns were all null)."""
        path = join(self.root, f"telemetry/{name}.parquet")
        try:
            earlier = read_table(self.fs, path)
        except (OSError, pa.ArrowInvalid):  # torn or replaced by hand: set aside, never appended to or lost
            self.fs.move(path, f"{path}.unreadable-{int(time.time())}")
            self.set_aside.append(f"telemetry/{name}.parquet")
            earlier = None
        if earlier is not None:
            table = pa.concat_tables([conform(name, earlier), table], promote_options="permissive")
        write_table(self.fs, path, table)

    def _drop_torn_parts(self) -> None:
        """Parts a killed run was writing (`.tmp`, never moved into place: their rows were in no committed
        shard's telemetry yet, as a shard commits only after its parts are in place)."""
        selector = pafs.FileSelector(join(self.root, PENDING), allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            if info.base_name.endswith(".tmp"):
                self.fs.delete_file(info.path)

    def _pending_parts(self, name: str) -> list[str]:
        selector = pafs.FileSelector(join(self.root, PENDING), allow_not_found=True)
        return sorted(i.path for i in self.fs.get_file_info(selector)
                      if i.base_name.startswith(f"{name}-") and i.base_name.endswith(".parquet"))


def _with_first_tokens(actors: pa.Table, updates: pa.Table | None) -> pa.Table:
    """telemetry/actors rows with their first_token_s: the earliest of the FIRST_TOKENS updates for each
    (actor_id, start_index)."""
    if updates is None:
        return actors
    earliest: dict[tuple, float] = {}
    for u in updates.to_pylist():
        key = (u["actor_id"], u["start_index"])
        earliest[key] = min(earliest.get(key, u["first_token_s"]), u["first_token_s"])
    firsts = []
    for actor_id, start_index, own in zip(actors["actor_id"].to_pylist(), actors["start_index"].to_pylist(),
                                          actors["first_token_s"].to_pylist()):
        found = [t for t in (own, earliest.get((actor_id, start_index))) if t is not None]
        firsts.append(min(found) if found else None)
    at = actors.schema.get_field_index("first_token_s")
    return actors.set_column(at, actors.schema.field(at), pa.array(firsts, actors.schema.field(at).type))
