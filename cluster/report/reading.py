"""What the report reads of an output: the manifest, the named columns of a Parquet file (absent ones as
null), and the committed result shards as one dataset (only those: a file in results/ the manifest did not commit is left
out, `strays`). Any file that cannot be read is one ReportError line naming it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.errors import RaysweepError
from cluster.contracts.shard import ShardState
from cluster.store.manifest import read_manifest
from cluster.store.telemetry_store import TelemetryStore


LOCAL = pafs.LocalFileSystem()  # the report reads an output on this machine's disk
LEFT_OUT = "left out"  # a committed shard whose file does not match its entry: the report reads none of it


class ReportError(RaysweepError, ValueError):
    """The output cannot be reported on; the message names the file."""


def load_manifest(root: Path) -> dict:
    if not root.is_dir():
        what = "a file, not a folder" if root.is_file() else "no such directory"
        raise ReportError(f"output {root}: {what} (expected a sweep's output, holding manifest.json)")
    try:
        manifest = read_manifest(str(root))  # with the commits journaled since, if the sweep is running or died
    except FileNotFoundError:
        raise ReportError(f"output {root}: no manifest.json, so not a raysweep sweep output") from None
    except (OSError, ValueError) as e:
        raise ReportError(f"output {root}/manifest.json: unreadable: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
        raise ReportError(f"output {root}/manifest.json: no `shards` mapping, so not a raysweep manifest")
    return manifest


def strays(root: Path, manifest: dict) -> list[str]:
    """The files in the output's results/ that the manifest did not commit (cluster/store/integrity.py): the
    report reads only committed files, so these are left out, and said."""
    from cluster.store.integrity import stray_files

    return stray_files(LOCAL, str(root.absolute()), manifest)


def damaged(root: Path, manifest: dict) -> tuple[dict, list[str]]:
    """The manifest with every committed shard whose file is there but not what was committed (another row
    count or checksum, unreadable, another shard's rows: cluster/store/integrity.py, as a resume and `raysweep
    verify` check) marked LEFT_OUT, so no reader of the report reads its file; and one line for each. A
    committed file that is missing stays an error (`committed`)."""
    import copy

    from cluster.store.integrity import mismatches

    found = [(sid, line) for sid, there, line in mismatches(LOCAL, str(root.absolute()), manifest)
             if there]
    if not found:
        return manifest, []
    manifest = copy.deepcopy(manifest)
    for sid, _ in found:
        manifest["shards"][sid]["state"] = LEFT_OUT
    return manifest, [line for _, line in found]


def read(path: Path, columns: list[str]) -> pa.Table | None:
    """The named columns of a Parquet file (summary.parquet), or None where there is no file; a column the file
    lacks is all null."""
    if not path.is_file():
        return None
    try:
        where = str(path.absolute())  # on the local filesystem: a folder named `run:1` is no URI
        have = set(pq.read_schema(where, filesystem=LOCAL).names)
        table = pq.read_table(where, columns=[c for c in columns if c in have], filesystem=LOCAL)
    except (OSError, pa.ArrowInvalid) as e:  # torn or replaced: say which file, in one line
        raise ReportError(f"output {path.parent}: {path.name} cannot be read "
                          f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]}); the sweep's next run "
                          "writes it again") from None
    for c in columns:
        if c not in have:
            table = table.append_column(c, pa.nulls(table.num_rows))
    return table.select(columns)


def telemetry(root: Path, name: str, columns: list[str]) -> pa.Table | None:
    """The named columns of telemetry/<name>.parquet with the parts a running or stopped sweep has not folded
    into it yet (cluster/store/telemetry_store.py so_far), or None where there is neither."""
    try:
        table = TelemetryStore(LOCAL, str(root.absolute())).so_far(name)
    except (OSError, pa.ArrowInvalid) as e:  # torn or replaced: say which file, in one line
        raise ReportError(f"output {root}: telemetry/{name}.parquet or a part of it not folded in yet cannot be "
                          f"read ({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]}); the sweep's next "
                          "run writes it again") from None
    return None if table is None else table.select(columns)


def telemetry_rows(root: Path, name: str, columns: list[str]) -> list[dict]:
    t = telemetry(root, name, columns)
    return [] if t is None else t.to_pylist()


def committed(root: Path, manifest: dict) -> ds.Dataset | None:
    """The committed result shards as one dataset (None where none is committed); a committed file that is
    missing is an error naming it."""
    files = sorted(root / s["file"] for s in manifest["shards"].values() if s.get("state") == ShardState.COMMITTED)
    for f in files:
        if not f.is_file():
            raise ReportError(f"output {root}/manifest.json: committed shard file {f} is missing")
    if not files:
        return None
    try:  # an output resumed by a later raysweep holds shard files with and without its newer columns
        schema = pa.unify_schemas([pq.read_schema(str(f.absolute()), filesystem=LOCAL) for f in files])
    except (OSError, pa.ArrowInvalid) as e:
        raise ReportError(f"output {root}: a committed shard file cannot be read: "
                          f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:160]}") from None
    return ds.dataset([str(f.absolute()) for f in files], schema=schema, format="parquet", filesystem=LOCAL)


def columns_of(dataset: ds.Dataset, wanted: list[str]) -> pa.Table:
    """`wanted` columns of every row of the dataset; a column no shard file has (an older output) is null.
    A file that lacks a column the others have reads it as null."""
    have = set(dataset.schema.names)
    table = dataset.to_table(columns=[c for c in wanted if c in have])
    for c in wanted:
        if c not in have:
            table = table.append_column(c, pa.nulls(table.num_rows))
    return table.select(wanted)
