"""Reading a data file: a regular file only (a FIFO or a device would block), its content hash, and its rows
streamed in batches: JSONL decoded line by line (so an error names its line), Parquet with binary columns
decoded as UTF-8 text."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import stat
from typing import Any, Iterator

from cluster.contracts.errors import RaysweepError

class DataError(RaysweepError, ValueError):
    """A task's data cannot be used; the message names the file and the line or column."""


BATCH_ROWS = 8192  # rows per batch when a data file is streamed
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only a line with one can decode to a lone surrogate
SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads, a pair is one code point: any left is alone
def not_regular(path: str | os.PathLike) -> str | None:
    """What `path` is where it is not a regular file ("a directory", "a named pipe (FIFO)", ...), None for a
    regular file; os.stat's OSError (no such file, no permission) is the caller's to word."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else \
        "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else \
        "not a regular file"


def file_problem(path, noun: str, kind_note: str) -> str | None:
    """Why `path` cannot be read as a regular file (missing, unreadable, a named pipe or device, which would block
    `open` or never end), as one line: `noun` names what it should be, `kind_note` follows a wrong kind; else None."""
    try:
        kind = not_regular(path)
    except FileNotFoundError:
        return f"{path}: no such {noun}"
    except OSError as e:
        return f"{path}: cannot be read: {e.strerror or e}"
    return None if kind is None else f"{path}: is {kind}{kind_note}"


def check_regular(path: str) -> None:
    """A data path must be a regular file."""
    problem = file_problem(path, "data file", "; `data:` names one JSONL or Parquet file")
    if problem is not None:
        raise DataError(problem)


def content_hash(path: str) -> str:
    """A hash of the file's bytes, read in 1 MiB blocks: a resume checks that its data is what its committed
    results were planned from (blake2b reads ~1 GB/s: a million-prompt file costs well under a second)."""
    check_regular(path)
    digest = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as e:  # check_regular said what it is; this is a read that failed
        raise DataError(f"{path}: cannot be read: {e.strerror or e}") from None
    return digest.hexdigest()


def _read_batches(path: str) -> Iterator[tuple[list[dict], list[str], int]]:
    """Rows in batches: the rows, where each was read (the 1-based line for JSONL, "row N" for
    Parquet) and the 0-based position of the batch's first row."""
    check_regular(path)
    if path.endswith(".parquet"):
        yield from _parquet_batches(path)
        return
    rows, lines, first = [], [], 0
    try:
        f = open(path, "rb")  # bytes, decoded line by line: a decoding error then knows its line
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}") from None
    with f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):  # as editors on Windows save: not part of the row
                raw = raw[len(codecs.BOM_UTF8):]
            row = _json_row(path, n, raw)
            if row is None:
                continue
            rows.append(row)
            lines.append(str(n))
            if len(rows) == BATCH_ROWS:
                yield rows, lines, first
                rows, lines, first = [], [], first + len(rows)
    if rows:
        yield rows, lines, first


class _KeyTwice(Exception):
    def __init__(self, key: str):
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object whose keys are each given once (`json` keeps the last of a key given twice, silently)."""
    row = dict(pairs)
    if len(row) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _KeyTwice(key)
            seen.add(key)
    return row


_JSON = json.JSONDecoder(object_pairs_hook=_object)


def _json_row(path: str, n: int, raw: bytes) -> dict | None:
    """Line `n` of a JSONL file as a row; None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    if not line.strip():
        return None
    try:
        row = _JSON.decode(line)
    except _KeyTwice as e:
        raise DataError(f"{path}:{n}: key {e.key!r} is given twice in one object (JSON readers differ on which one "
                        "counts); give it once") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{path}:{n}: JSON nested too deep to read (thousands of levels)") from None
    except ValueError as e:  # an integer of more than 4,300 digits (Python's limit on int conversion)
        raise DataError(f"{path}:{n}: not a value raysweep reads: {str(e).split(';')[0]}") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
    if SURROGATE_ESCAPE.search(raw):
        column = next((k for k, v in row.items() if _lone_surrogate(k) or _lone_surrogate(v)), None)
        if column is not None:
            raise DataError(f"{path}:{n}: column {column!r} holds a lone surrogate (an unpaired \\uD800-\\uDFFF "
                            "escape), which is not text")
    return row


def _lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return SURROGATE.search(value) is not None
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    return False


def _parquet_batches(path: str) -> Iterator[tuple[list[dict], list[str], int]]:
    import pyarrow.parquet as pq

    try:
        source = pq.ParquetFile(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except Exception as e:  # pyarrow's ArrowInvalid etc.: say which file
        raise DataError(f"{path}: not a readable Parquet file: {_first_line(e)}") from None
    n = 0
    batches = source.iter_batches(batch_size=BATCH_ROWS)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # a corrupt page, or strings that are not UTF-8
            raise DataError(f"{path}: not a readable Parquet file (after row {n}): {_first_line(e)}") from None
        rows = _python_rows(_as_text(batch, path, n), path, n)
        yield rows, [f"row {i}" for i in range(n, n + len(rows))], n
        n += len(rows)


def _python_rows(batch, path: str, first: int) -> list[dict]:
    """The batch's rows as Python values, maps as dicts; a value Python cannot hold (a map with a key twice, a
    value out of Python's range) is one line naming the column."""
    names = batch.schema.names
    twice = next((name for k, name in enumerate(names) if name in names[:k]), None)
    if twice is not None:  # a row would keep only the last one's value
        raise DataError(f"{path}: column {twice!r} is there twice; name each column once")
    columns = []
    for i, field in enumerate(batch.schema):
        try:
            columns.append(batch.column(i).to_pylist(maps_as_pydicts="strict"))
        except Exception as e:
            raise DataError(f"{path}: rows {first}-{first + batch.num_rows - 1}: column {field.name!r} ({field.type}) "
                            f"cannot be read as Python values: {_first_line(e)}") from None
    return [dict(zip(names, values)) for values in zip(*columns)] if columns else [{} for _ in range(batch.num_rows)]


def _binary(t) -> bool:
    import pyarrow as pa

    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or \
        getattr(pa.types, "is_binary_view", lambda _: False)(t)


def _temporal(t) -> bool:
    import pyarrow as pa

    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t)


def _unrenderable(t) -> bool:
    """Types with no text a user would write the same way (a duration's `0:01:30`, or `0 days 00:00:01.5`
    where pandas is installed) or none at all (intervals)."""
    import pyarrow as pa

    return pa.types.is_duration(t) or pa.types.is_interval(t)


def _as_text(batch, path: str, first: int):
    """Each column's values as a prompt, a target and a scorer read them (every Arrow type that can
    reach a prompt or target is rendered as the user expects, or refused naming the file and column):
    - binary decoded as UTF-8 (read as `b'...'` it scored the right answer 0); bytes that are not UTF-8 refused;
    - timestamps, dates and times as text, exactly (`render_temporal`): nanoseconds kept, years past 9999 read;
    - float16 and float32 as the shortest decimal of their own width (0.1 stays 0.1, not 0.10000000149011612);
    - durations and intervals, and binary inside a list, struct or map, refused;
    - dictionary-encoded columns as the values they encode.
    Lists, structs and maps of the rest are read as Python values (a map as a dict)."""
    import pyarrow as pa

    for i, field in enumerate(batch.schema):
        t, column = field.type, batch.column(i)
        if pa.types.is_dictionary(t):  # categories (pandas' category dtype): read as the values they stand for
            column, t = column.dictionary_decode(), t.value_type
            batch = batch.set_column(i, pa.field(field.name, t), column)
        leaves = _leaf_types(t)
        if _binary(t):
            batch = batch.set_column(i, pa.field(field.name, pa.string()), _decoded(column, path, first, field.name))
        elif _temporal(t):
            batch = batch.set_column(i, pa.field(field.name, pa.string()), render_temporal(column))
        elif pa.types.is_float16(t) or pa.types.is_float32(t):
            batch = batch.set_column(i, pa.field(field.name, pa.float64()), _shortest_float64(column))
        elif any(_unrenderable(leaf) for leaf in leaves):
            raise DataError(f"{path}: column {field.name!r} is {t}, which has no text form raysweep could render "
                            "as a prompt or compare as a target: store it as a number (e.g. seconds) or as text")
        elif len(leaves) > 1 or leaves[0] is not t:  # a list, struct or map
            if any(_binary(leaf) for leaf in leaves):
                raise DataError(f"{path}: column {field.name!r} holds binary values inside a {t}; raysweep "
                                "reads text: store them as strings")
            text = _with_text_leaves(t)
            if text != t:  # dates, times and narrow floats inside: as text, in Arrow's own form
                batch = batch.set_column(i, pa.field(field.name, text), column.cast(text))
    return batch


def render_temporal(column):
    """Timestamps, dates and times as the text Python's `str` gives whole-second values (`2024-01-02 03:04:05`,
    `2024-01-02 03:04:05+00:00`), computed by Arrow so that it is exact at every unit and needs no pandas:
    a fraction keeps its significant digits (`03:04:05.123`, `…05.123456789`), none when it is zero."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = column.cast(pa.string())
    if pa.types.is_date(column.type):
        return text
    tz = r"((?:Z|[+-]\d{4})?)$"
    text = pc.replace_substring_regex(text, r"\.(\d*[1-9])0*" + tz, r".\1\2")  # trailing zeros of a fraction
    text = pc.replace_substring_regex(text, r"\.0+" + tz, r"\1")  # a fraction of zeros: none
    if pa.types.is_timestamp(column.type) and column.type.tz is not None:  # ISO 8601's offset, as Python writes it
        text = pc.replace_substring_regex(text, r"Z$", "+00:00")
        text = pc.replace_substring_regex(text, r"([+-]\d{2})(\d{2})$", r"\1:\2")
    return text


def _shortest_float64(column):
    """A float16 or float32 column as float64 holding the shortest decimal that reads back to the same value
    at its own width: what the writer meant (0.1), not the wider type's expansion of it."""
    import pyarrow as pa

    if pa.types.is_float16(column.type):
        import numpy as np

        values = [None if v is None else float(str(np.float16(v))) for v in column.to_pylist()]
        return pa.array(values, pa.float64())
    return column.cast(pa.string()).cast(pa.float64())


def _with_text_leaves(t):
    """`t` with its temporal leaves as strings and its narrow floats as float64 (Arrow casts nested values)."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return pa.list_(_with_text_leaves(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(k).name, _with_text_leaves(t.field(k).type)) for k in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(_with_text_leaves(t.key_type), _with_text_leaves(t.item_type))
    if _temporal(t):
        return pa.string()
    if pa.types.is_float16(t) or pa.types.is_float32(t):
        return pa.float64()
    return t


def _decoded(column, path: str, first: int, name: str):
    import pyarrow as pa

    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        bad = next(k for k, v in enumerate(column.to_pylist()) if v is not None and not _utf8(v))
        raise DataError(f"{path}: row {first + bad}: column {name!r} holds bytes that are not UTF-8 text") from None


def _leaf_types(t) -> list:
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_types(t.value_type)
    if pa.types.is_struct(t):
        return [leaf for k in range(t.num_fields) for leaf in _leaf_types(t.field(k).type)]
    if pa.types.is_map(t):
        return _leaf_types(t.key_type) + _leaf_types(t.item_type)
    return [t]


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
