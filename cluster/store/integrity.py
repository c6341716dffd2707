"""Files you can trust: each committed results file's row count and checksum are in the manifest
(`rows`, `checksum`), and a resume (ResultSink) and `raysweep verify` check every committed file against
them before anything else, naming the shard whose file is missing, unreadable or not what was committed.

Outputs committed before checksums were recorded are checked by row count and by their rows' `shard_id`
(a file copied over another's carries the other shard's id)."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.shard import ShardState
from cluster.store.output_files import SinkError, join

CHUNK = 1 << 20


def checksum(data: bytes) -> str:
    """The checksum a manifest entry records for its file's bytes."""
    return "blake2b:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def file_checksum(fs: pafs.FileSystem, path: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with fs.open_input_stream(path) as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return "blake2b:" + digest.hexdigest()


def table_bytes(table: pa.Table) -> bytes:
    """A results table as the Parquet bytes its file will hold (so they are checksummed before the write)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def problems(fs: pafs.FileSystem, root: str, manifest: dict) -> list[str]:
    """One line per committed shard whose file does not match its manifest entry (empty: all match)."""
    found = []
    for sid, entry in sorted(manifest.get("shards", {}).items()):
        if entry.get("state") != ShardState.COMMITTED or not entry.get("file"):
            continue
        path, rel = join(root, entry["file"]), entry["file"]
        if fs.get_file_info(path).type != pafs.FileType.File:
            found.append(f"shard {sid}: its results file {rel} is missing")
            continue
        try:
            with fs.open_input_file(path) as f:
                parquet = pq.ParquetFile(f)
                rows = parquet.metadata.num_rows
                ids = None if "checksum" in entry or "shard_id" not in parquet.schema_arrow.names else \
                    set(parquet.read(columns=["shard_id"]).column(0).to_pylist())
        except (OSError, pa.ArrowInvalid) as e:
            found.append(f"shard {sid}: its results file {rel} cannot be read "
                         f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})")
            continue
        if "rows" in entry and rows != entry["rows"]:
            found.append(f"shard {sid}: its results file {rel} has {rows} rows, {entry['rows']} were committed")
        elif "checksum" in entry and file_checksum(fs, path) != entry["checksum"]:
            found.append(f"shard {sid}: its results file {rel} changed after it was committed (checksum)")
        elif ids is not None and ids != {sid}:
            found.append(f"shard {sid}: its results file {rel} holds the rows of shard(s) "
                         f"{', '.join(sorted(str(i) for i in ids))}")
    return found


def check_committed(fs: pafs.FileSystem, root: str, output: str, manifest: dict) -> None:
    """SinkError naming the first shards whose files do not match, before a resume builds on them."""
    found = problems(fs, root, manifest)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise SinkError(f"output {output}: {'; '.join(found[:3])}{more}: restore the file(s), or --new-run to "
                        "discard the output's results")
