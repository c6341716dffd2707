"""An output location's files (docs/design.md, Output): opening it on any pyarrow filesystem URI, the lock held while a
sweep writes it, and writes by rename, so that a reader never sees half a file.

Results lie in results/<model>/<task>/shard-NNNNN.parquet with model and task as string columns in the
files, not as hive key=value folders (see `result_file`): pyarrow, pandas, polars, DuckDB and Ray Data
then read the folder as one table whatever the names.
"""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cluster.contracts.errors import RaysweepError

LOCK = ".lock"  # held (flock) while a sweep writes the output; removed when it is done


class SinkError(RaysweepError, RuntimeError):
    """The output location cannot be used; the message names it."""


class OutputWriteError(SinkError):
    """Writing to the output failed mid-run (the disk full, the folder made read-only): what was committed
    before is kept, and the same command resumes once the cause is fixed. A run's failure: exit 1."""
    exit_code = 1


# filesystems that keep what is written: local files, object stores, HDFS (pyarrow's, by URI scheme)
DURABLE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


def filesystem(output: str) -> tuple[pafs.FileSystem, str]:
    """The output's pyarrow filesystem and root; SinkError for a scheme that does not keep what is written
    (`mock://`, pyarrow's in-memory filesystem, is gone when the process ends) or that pyarrow does not know."""
    if "://" in output:
        scheme = output.split("://", 1)[0].lower()
        if scheme not in DURABLE_SCHEMES:
            why = "pyarrow's in-memory filesystem, gone when the run ends" if scheme == "mock" else "not a filesystem raysweep writes to"
            raise SinkError(f"output {output}: cannot be opened: {scheme}:// is {why}; use a local path or one of "
                            f"{', '.join(s + '://' for s in DURABLE_SCHEMES)}")
        return pafs.FileSystem.from_uri(output)
    return pafs.LocalFileSystem(), os.path.abspath(output)


def open_output(output: str) -> tuple[pafs.FileSystem, str, list[str]]:
    """The output's filesystem and root, created and checked writable, and the local folders made for it, the
    deepest first (`remove_made` takes those left empty away again); SinkError where it cannot be used."""
    try:
        fs, root = filesystem(output)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid (an unknown scheme) is a ValueError
        raise SinkError(f"output {output}: cannot be opened: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    if os.path.islink(root) and not os.path.exists(root) and isinstance(fs, pafs.LocalFileSystem):
        raise SinkError(f"output {output}: a symbolic link to {os.readlink(root)}, which is not there; make that "
                        "folder, or give another output")
    made = _missing_folders(root) if isinstance(fs, pafs.LocalFileSystem) else []
    try:
        fs.create_dir(root, recursive=True)
        write_bytes(fs, join(root, ".write-test"), b"")
        fs.delete_file(join(root, ".write-test"))
    except OSError as e:
        remove_made(made)
        raise SinkError(f"output {output}: not writable: {e}") from None
    return fs, root, made


def _missing_folders(root: str) -> list[str]:
    """`root` and each of its parents that is not there yet, the deepest first."""
    missing = []
    while not os.path.lexists(root) and os.path.dirname(root) != root:
        missing.append(root)
        root = os.path.dirname(root)
    return missing


def remove_made(folders: list[str]) -> None:
    """The folders `open_output` made, removed where they are still empty (a run that ended before it wrote
    anything, as when Ray could not be reached, leaves no empty output behind), the deepest first."""
    for folder in folders:
        try:
            os.rmdir(folder)  # only an empty folder: whatever a run or anyone else wrote there stays
        except OSError:
            return


def join(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}"


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_table(fs: pafs.FileSystem, path: str, table: pa.Table, tmp: str | None = None) -> None:
    """`table` written under a temporary name (`tmp`, else a hidden one beside it), then renamed into place."""
    tmp = tmp or f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp"
    fs.create_dir(os.path.dirname(path), recursive=True)
    try:
        with fs.open_output_stream(tmp) as f:
            pq.write_table(table, f)
        fs.move(tmp, path)
    except OSError:
        _remove_quietly(fs, tmp)
        raise


def _remove_quietly(fs: pafs.FileSystem, tmp: str) -> None:
    """A failed write's temporary file, removed where it can be (the next run removes what is left)."""
    try:
        fs.delete_file(tmp)
    except OSError:  # never written, or the folder is read-only now
        pass


def write_bytes_renamed(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """`data` written under a hidden temporary name beside `path`, then renamed into place; a write that fails
    (the disk full) removes its temporary file where it can."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp"
    fs.create_dir(os.path.dirname(path), recursive=True)
    try:
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, path)
    except OSError:
        _remove_quietly(fs, tmp)
        raise


def read_table(fs: pafs.FileSystem, path: str) -> pa.Table | None:
    """The Parquet file at `path`, or None where there is none."""
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_file(path) as f:
        return pq.read_table(f)


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


def plain_strings(table: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    """The named columns as plain strings: a dictionary-encoded column reads back as a pandas category and
    a polars Categorical, not as text."""
    for name in columns:
        if name in table.column_names and table.schema.field(name).type != pa.string():
            table = table.set_column(table.schema.get_field_index(name), name, table[name].cast(pa.string()))
    return table


def lock(fs: pafs.FileSystem, root: str, output: str):
    """An exclusive lock on a local output (flock: the OS drops it when the holder dies, even by
    kill -9). Object stores have no such lock; there two sweeps into one output are not prevented."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return None
    import fcntl
    import socket

    path = os.path.join(root, LOCK)
    while True:
        try:
            handle = open(path, "a+")
        except OSError as e:  # a folder or a file of another owner by that name: not a sweep's lock
            raise SinkError(f"output {output}: {LOCK}: cannot be opened as the lock a sweep holds while it writes "
                            f"there ({e.strerror or e}); remove it if no sweep is writing there") from None
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


def unlock(handle, root: str) -> None:
    """Let go of `lock`'s handle: the file is removed while still held (see `lock`); a clean exit leaves none."""
    if handle is None:
        return
    try:
        os.remove(join(root, LOCK))
    except FileNotFoundError:
        pass
    except OSError:  # the folder was made read-only: the lock is released all the same, the file stays
        pass
    handle.close()  # closing the file releases the flock


def remove_leftover_tmp(fs: pafs.FileSystem, root: str) -> int:
    """Remove the temporary files (`.NAME.XXXXXXXX.tmp`) a run that died left beside the output's files: none
    of them was renamed into place, so none holds anything committed. Called with the output's lock held.
    Telemetry's own parts are the telemetry store's (cluster/store/telemetry_store.py)."""
    removed = 0
    for folder, recursive in ((root, False), (join(root, "results"), True)):
        if fs.get_file_info(folder).type != pafs.FileType.Directory:
            continue
        for info in fs.get_file_info(pafs.FileSelector(folder, recursive=recursive)):
            if info.type == pafs.FileType.File and info.base_name.startswith(".") and info.base_name.endswith(".tmp"):
                fs.delete_file(info.path)
                removed += 1
    return removed
