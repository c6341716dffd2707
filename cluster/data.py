"""Task data: JSONL or Parquet rows in, sample ids and rendered prompts out.

Every problem with a data file is raised as `DataError` naming the file and, for JSONL, the line.
Prompts are rendered once per model (chat templates differ between models) by `render_prompts`.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from cluster.spec import SweepSpec, TaskSpec


class DataError(ValueError):
    """A task's data cannot be used; the message names the file and the line or column."""


BATCH_ROWS = 8192  # rows per batch when a data file is streamed


@dataclass(frozen=True)
class RowBatch:
    ids: list[str]  # sample ids
    rows: list[dict]  # one dict per sample, as read
    where: list[str]  # "LINE" (JSONL, 1-based) or "row N" (Parquet), for error messages


@dataclass(frozen=True)
class TaskData:
    """A task's data file, checked: every row parses, has the columns the task reads and a unique id.
    Rows are not held: `batches()` streams them again (once per model, whose chat template differs)."""
    task: TaskSpec
    path: str
    n_rows: int

    def batches(self) -> Iterator[RowBatch]:
        for rows, where, first in _read_batches(self.path):
            yield RowBatch(_ids(self.task, rows, first), rows, where)

    def target_of(self, row: dict) -> Any:
        return row.get(self.task.target) if self.task.target else None


def content_hash(path: str) -> str:
    """A hash of the file's bytes, read in 1 MiB blocks: a resume checks that its data is what its committed
    results were planned from (blake2b reads ~1 GB/s: a million-prompt file costs well under a second)."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory; `data:` names one JSONL or Parquet file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}") from None
    return digest.hexdigest()


def data_hashes(spec: SweepSpec) -> dict[str, dict]:
    """Per task, its data file and that file's content hash (the manifest keeps them)."""
    return {task.name: {"path": spec.data_path(task), "hash": content_hash(spec.data_path(task))}
            for task in spec.tasks}


def template_fields(template: str) -> list[str]:
    """The column names a str.format template reads: 'Q: {question[0]}' -> ['question']."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            root = field.split(".")[0].split("[")[0]
            if not root or root.isdigit():
                raise ValueError(f"prompt: placeholder {{{field}}} must name a column")
            names.append(root)
    return names


def load_task(spec: SweepSpec, task: TaskSpec) -> TaskData:
    """Check the task's data file in one streaming pass, keeping 8 bytes per row: duplicate ids are
    found from 64-bit id hashes (sorted at the end) and confirmed on a second read."""
    path = spec.data_path(task)
    try:
        template_fields(task.prompt or "")
    except ValueError as e:
        raise DataError(f"{spec.source}: tasks.{task.name}.{e}") from None
    hashes, n = [], 0
    for rows, where, first in _read_batches(path):
        _check_columns(task, path, rows, where)
        hashes.append(np.fromiter((_id_hash(sid) for sid in _ids(task, rows, first)), dtype=np.uint64, count=len(rows)))
        n += len(rows)
    if n == 0:
        raise DataError(f"{path}: task {task.name!r} has no rows")
    ordered = np.sort(np.concatenate(hashes))
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(same):
        _raise_duplicate(task, path, {int(h) for h in ordered[same]})
    return TaskData(task=task, path=path, n_rows=n)


def render_prompts(task: TaskSpec, batch: RowBatch, tokenizer, path: str = "") -> tuple[list[str], bool]:
    """Prompt texts of a batch, and whether the tokenizer should add its special tokens (False for
    chat-rendered text, whose template already holds them)."""
    if task.messages is None and not task.chat:
        return [task.prompt.format(**row) for row in batch.rows], True
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"task {task.name}: the model's tokenizer has no chat template")
    prompts = []
    for sid, row in zip(batch.ids, batch.rows):
        messages = list(row[task.messages]) if task.messages else [{"role": "user", "content": task.prompt.format(**row)}]
        if task.system is not None:
            messages.insert(0, {"role": "system", "content": task.system})
        try:
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as e:  # a template error must stop the sweep, never change the prompt quietly
            raise DataError(f"{path}: sample {sid}: chat template failed: {e}") from None
    return prompts, False


def _ids(task: TaskSpec, rows: list[dict], first: int) -> list[str]:
    """Sample ids: the id column's values, else the row's 0-based position in the file."""
    if task.id_column is None:
        return [str(i) for i in range(first, first + len(rows))]
    return [str(row[task.id_column]) for row in rows]


def _id_hash(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _raise_duplicate(task: TaskSpec, path: str, suspects: set[int]) -> None:
    seen: dict[str, str] = {}
    for rows, where, first in _read_batches(path):
        for sid, w in zip(_ids(task, rows, first), where):
            if _id_hash(sid) in suspects:
                if sid in seen:
                    raise DataError(f"{path}:{w}: duplicate sample id {sid!r} (first at {seen[sid]})")
                seen[sid] = w


def _read_batches(path: str) -> Iterator[tuple[list[dict], list[str], int]]:
    """Rows in batches: the rows, where each was read (the 1-based line for JSONL, "row N" for
    Parquet) and the 0-based position of the batch's first row."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            source = pq.ParquetFile(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such data file") from None
        except Exception as e:  # pyarrow's ArrowInvalid etc.: say which file
            raise DataError(f"{path}: not a readable Parquet file: {e}") from None
        n = 0
        for batch in source.iter_batches(batch_size=BATCH_ROWS):
            rows = batch.to_pylist()
            yield rows, [f"row {i}" for i in range(n, n + len(rows))], n
            n += len(rows)
        return
    rows, lines, first = [], [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
                lines.append(str(n))
                if len(rows) == BATCH_ROWS:
                    yield rows, lines, first
                    rows, lines, first = [], [], first + len(rows)
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text: {e}") from None
    if rows:
        yield rows, lines, first


def _check_columns(task: TaskSpec, path: str, rows: list[dict], where: list[str]) -> None:
    needed = {c: f"prompt placeholder {{{c}}}" for c in template_fields(task.prompt or "")}
    for field_name in ("messages", "target", "id_column"):
        column = getattr(task, field_name)
        if column is not None:
            needed[column] = f"`{field_name}` column"
    for i, row in enumerate(rows):
        for column, why in needed.items():
            if column not in row:
                raise DataError(f"{path}:{where[i]}: missing column {column!r} "
                                f"(the task {task.name!r} needs it as its {why})")
