"""Older results widened: result files an earlier raysweep committed with fewer columns (an output resumed
across a change of the results' schema, cluster/contracts/results_schema.py) get the missing columns as
nulls, in RESULT_SCHEMA's order. polars and DuckDB read a folder with the first file's schema and fail on
(or miss) columns only later files have.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.results_schema import RESULT_SCHEMA
from cluster.store.manifest import is_committed
from cluster.store.integrity import checksum, table_bytes
from cluster.store.output_files import SinkError, join, write_bytes_renamed


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
