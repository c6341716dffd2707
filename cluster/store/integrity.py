"""Files you can trust: each committed results file's row count and checksum are in the manifest
(`rows`, `checksum`), and a resume (ResultSink) and `raysweep verify` check every committed file against
them before anything else, naming the shard whose file is missing, unreadable or not what was committed.

Outputs committed before checksums were recorded are checked by row count and by their rows' `shard_id`
(a file copied over another's carries the other shard's id).

results/ holds only the files the manifest committed: every reader of the folder (pyarrow.dataset, pandas,
DuckDB) reads all of it, so a file no committed entry names (copied, renamed, put there by hand) would add
its rows to the results. `stray_files` lists them; the resume, `raysweep verify` and the report name them."""

from __future__ import annotations

import hashlib
import re

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.shard import ShardState
from cluster.store.output_files import SinkError, join

CHUNK = 1 << 20
TMP = re.compile(r"\..+\.[0-9a-f]{8}\.tmp")  # a file being written under its temporary name (output_files.py)


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
    return [line for _, _, line in mismatches(fs, root, manifest)]


def mismatches(fs: pafs.FileSystem, root: str, manifest: dict) -> list[tuple[str, bool, str]]:
    """(shard id, whether its file is there, the line) for each committed shard whose file does not match its
    manifest entry: missing, unreadable, of another row count or checksum, or holding another shard's rows."""
    found = []
    for sid, entry in sorted(manifest.get("shards", {}).items()):
        if entry.get("state") != ShardState.COMMITTED or not entry.get("file"):
            continue
        path, rel = join(root, entry["file"]), entry["file"]
        if fs.get_file_info(path).type != pafs.FileType.File:
            found.append((sid, False, f"shard {sid}: its results file {rel} is missing"))
            continue
        try:
            with fs.open_input_file(path) as f:
                parquet = pq.ParquetFile(f)
                rows = parquet.metadata.num_rows
                ids = None if "checksum" in entry or "shard_id" not in parquet.schema_arrow.names else \
                    set(parquet.read(columns=["shard_id"]).column(0).to_pylist())
        except (OSError, pa.ArrowInvalid) as e:
            found.append((sid, True, f"shard {sid}: its results file {rel} cannot be read "
                                     f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})"))
            continue
        if "rows" in entry and rows != entry["rows"]:
            found.append((sid, True, f"shard {sid}: its results file {rel} has {rows} rows, {entry['rows']} were "
                                     "committed"))
        elif "checksum" in entry and file_checksum(fs, path) != entry["checksum"]:
            found.append((sid, True, f"shard {sid}: its results file {rel} changed after it was committed (checksum)"))
        elif ids is not None and ids != {sid}:
            found.append((sid, True, f"shard {sid}: its results file {rel} holds the rows of shard(s) "
                                     f"{', '.join(sorted(str(i) for i in ids))}"))
    return found


def stray_files(fs: pafs.FileSystem, root: str, manifest: dict) -> list[str]:
    """The files under results/ (relative to the output, sorted) that no committed shard's entry names; a
    running sweep's temporary files (`.NAME.XXXXXXXX.tmp`, not yet renamed into place) are left out."""
    results = join(root, "results")
    if fs.get_file_info(results).type != pafs.FileType.Directory:
        return []
    committed = {e.get("file") for e in manifest.get("shards", {}).values() if e.get("state") == ShardState.COMMITTED}
    found = []
    for info in fs.get_file_info(pafs.FileSelector(results, recursive=True)):
        rel = "results/" + info.path[len(results):].lstrip("/")
        if info.type != pafs.FileType.Directory and rel not in committed and not TMP.fullmatch(info.base_name):
            found.append(rel)
    return sorted(found)


def stray_line(rel: str) -> str:
    return (f"{rel}: in results/ but committed by no shard of manifest.json (a stray, copied or renamed file; "
            "every reader of results/ would read it too)")


def _unrecorded(manifest: dict) -> set[str]:
    """The files of the shards the manifest holds but not as committed: a run killed between renaming a shard's
    file into place and recording it leaves one (that shard runs again, and its file is written again)."""
    files = set()
    for sid, entry in manifest.get("shards", {}).items():
        model, _, rest = sid.partition("/")
        task, _, index = rest.partition("/")
        if entry.get("state") != ShardState.COMMITTED and index.isdigit():
            files.add(f"results/{model}/{task}/shard-{int(index):05d}.parquet")
    return files


def check_committed(fs: pafs.FileSystem, root: str, output: str, manifest: dict) -> None:
    """SinkError naming the first shards whose files do not match, and the files in results/ the manifest did
    not commit, before a resume builds on them. (Called with the output locked: an uncommitted shard's own
    file, left by a killed run, is removed.)"""
    changed = problems(fs, root, manifest)
    unrecorded = _unrecorded(manifest)
    strays = []
    for rel in stray_files(fs, root, manifest):
        if rel in unrecorded:
            fs.delete_file(join(root, rel))
        else:
            strays.append(stray_line(rel))
    found = changed + strays
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        todo = " and ".join(what for what, needed in (("restore the committed file(s)", changed),
                                                      ("remove the file(s) no shard committed", strays))
                            if needed)  # a committed file removed is missing: restored, or the output started anew
        raise SinkError(f"output {output}: {'; '.join(found[:3])}{more}: {todo}, or --new-run to discard the "
                        "output's results")
