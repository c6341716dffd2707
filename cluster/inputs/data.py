"""Task data: JSONL or Parquet rows in, sample ids and rendered prompts out.

Every problem with a data file is raised as `DataError` naming the file and, for JSONL, the line:
bytes that are not UTF-8, a line that is not a JSON object, a lone surrogate ("\\ud800", which Python's
JSON parser accepts), a missing column, a null where the task needs a value (the id column, a prompt
placeholder's column, the target column: a null answer would be scored 0, a null question rendered as
"None"), a `messages` value that is not a non-empty list of {role, content} strings, a duplicate id, a
row the prompt template or a code_exec program template cannot render. A UTF-8 byte order mark at the
start of a JSONL file is skipped.
Prompts are rendered once per model (chat templates differ between models) by `render_prompts`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from cluster.contracts.errors import RaysweepError
from cluster.contracts.spec import SweepSpec, TaskSpec
from cluster.contracts.loglikelihood import choices_problem, row_choices, target_index
from cluster.contracts.task_spec import COMPLETION, template_fields


class DataError(RaysweepError, ValueError):
    """A task's data cannot be used; the message names the file and the line or column."""


BATCH_ROWS = 8192  # rows per batch when a data file is streamed
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only a line with one can decode to a lone surrogate
SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads, a pair is one code point: any left is alone
RENDER_ERRORS = (KeyError, IndexError, ValueError, TypeError, AttributeError)  # what str.format raises on a row


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

    def extra_of(self, row: dict) -> dict | None:
        """What a row carries beside its prompt and target, for the engine or the scorer: a loglikelihood
        row's choices, the columns a code_exec program reads, a replay task's completions."""
        return row_extra(self.task, row)


def row_extra(task: TaskSpec, row: dict) -> dict | None:
    extra = {}
    if task.loglikelihood:
        extra["choices"] = row_choices(task, row)
    if task.scorer is not None and task.scorer.columns():
        extra["columns"] = {c: row[c] for c in task.scorer.columns()}
    if task.replay is not None:
        extra["replay"] = row[task.replay.column]
    return extra or None


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


def load_task(spec: SweepSpec, task: TaskSpec) -> TaskData:
    """Check the task's data file in one streaming pass, keeping 8 bytes per row: every row parses, holds
    the task's columns and renders its prompt template; duplicate ids are found from 64-bit id hashes
    (sorted at the end) and confirmed on a second read. Cheap (no tokenizer): it runs before Ray starts."""
    path = spec.data_path(task)
    try:
        template_fields(task.prompt or "")
    except ValueError as e:
        raise DataError(f"{spec.source}: tasks.{task.name}.{e}") from None
    hashes, n = [], 0
    for rows, where, first in _read_batches(path):
        _check_columns(task, path, rows, where)
        _check_rendering(task, path, rows, where)
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
        try:  # load_task checked every row; what still fails here names its sample
            if task.messages:
                messages = list(row[task.messages])
            else:
                messages = [{"role": "user", "content": task.prompt.format(**row)}]
            if task.system is not None:
                messages.insert(0, {"role": "system", "content": task.system})
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as e:  # a template error must stop the sweep, never change the prompt quietly
            raise DataError(f"{path}: sample {sid}: chat template failed: {e}") from None
    return prompts, False


def _ids(task: TaskSpec, rows: list[dict], first: int) -> list[str]:
    """Sample ids: the id column's values, else the row's 0-based position in the file."""
    if task.id_column is None:
        return [str(i) for i in range(first, first + len(rows))]
    return [str(row[task.id_column]) for row in rows]


def rows_with_ids(task: TaskSpec, path: str, ids: set[str]) -> Iterator[tuple[str, dict]]:
    """(sample id, row) of the rows of `path` whose ids are in `ids`, in file order (`raysweep verify`)."""
    for rows, _, first in _read_batches(path):
        for sid, row in zip(_ids(task, rows, first), rows):
            if sid in ids:
                yield sid, row


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
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; `data:` names one JSONL or Parquet file")
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


def _json_row(path: str, n: int, raw: bytes) -> dict | None:
    """Line `n` of a JSONL file as a row; None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
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
            rows = next(batches).to_pylist()
        except StopIteration:
            return
        except Exception as e:  # a corrupt page, or strings that are not UTF-8
            raise DataError(f"{path}: not a readable Parquet file (after row {n}): {_first_line(e)}") from None
        yield rows, [f"row {i}" for i in range(n, n + len(rows))], n
        n += len(rows)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _check_rendering(task: TaskSpec, path: str, rows: list[dict], where: list[str]) -> None:
    """Render the prompt template on every row, as planning will, and a code_exec program as scoring will
    (with an empty completion, which a model may return): a format spec or an index the row's value does
    not take ("{question:d}" on text, "{question[999]}", "{meta[fn]}" where a row's meta has no fn) fails
    here, naming the row, not at scoring time after the GPU work."""
    program = task.scorer.args["program"] if task.scorer is not None and task.scorer.name == "code_exec" else None
    for row, w in zip(rows, where):
        try:
            if task.prompt is not None:
                task.prompt.format(**row)
        except RENDER_ERRORS as e:
            raise DataError(f"{path}:{w}: tasks.{task.name}.prompt {task.prompt!r} cannot be rendered from this "
                            f"row: {type(e).__name__}: {_first_line(e)}") from None
        if program is None:
            continue
        try:  # the mapping cluster/score/shard_scoring.py formats it from
            program.format(**{c: row[c] for c in task.scorer.columns()}, **{COMPLETION: ""})
        except RENDER_ERRORS as e:
            raise DataError(f"{path}:{w}: tasks.{task.name}.scorer.program {program!r} cannot be rendered from "
                            f"this row and an empty completion: {type(e).__name__}: {_first_line(e)}") from None


def _check_columns(task: TaskSpec, path: str, rows: list[dict], where: list[str]) -> None:
    """Every column the task reads is there and holds a value: null is refused in the id column, a prompt
    placeholder's column and the target column (a null answer is no reference to score against; a row
    without one belongs in another task); the `messages` column holds chat messages (`_messages_problem`)."""
    needed = {c: f"prompt placeholder {{{c}}}" for c in template_fields(task.prompt or "")}
    for field_name in ("messages", "target", "id_column"):
        column = getattr(task, field_name)
        if column is not None:
            needed[column] = f"`{field_name}` column"
    if isinstance(task.choices, str):
        needed[task.choices] = "`choices` column"
    if task.replay is not None:
        needed[task.replay.column] = "`replay.column` (its completions)"
    for column in task.scorer.columns() if task.scorer is not None else ():
        needed.setdefault(column, f"code_exec program placeholder {{{column}}}")
    for i, row in enumerate(rows):
        for column, why in needed.items():
            if column not in row:
                raise DataError(f"{path}:{where[i]}: missing column {column!r} "
                                f"(the task {task.name!r} needs it as its {why})")
            if row[column] is None and column != task.messages:
                raise DataError(f"{path}:{where[i]}: column {column!r} is null "
                                f"(the task {task.name!r} needs a value as its {why})")
        if task.messages is not None:
            problem = _messages_problem(row[task.messages])
            if problem:
                raise DataError(f"{path}:{where[i]}: column {task.messages!r} (tasks.{task.name}.messages) {problem}")
        if task.loglikelihood:
            _check_choices(task, path, row, where[i])
        if task.replay is not None:
            _check_replayed(task, path, row[task.replay.column], where[i])


def _check_replayed(task: TaskSpec, path: str, value: Any, where: str) -> None:
    """A replay column holds the completion (a string) or completions (a non-empty list of them), as many
    as the task's largest pass@k needs."""
    what = f"column {task.replay.column!r} (tasks.{task.name}.replay.column)"
    if not (isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))):
        raise DataError(f"{path}:{where}: {what} must hold the completion (a string) or a non-empty list of "
                        f"completions, got {_json_type(value)}")
    n = 1 if isinstance(value, str) else len(value)
    if task.pass_at and max(task.pass_at) > n:
        raise DataError(f"{path}:{where}: {what} holds {n} completion(s), fewer than tasks.{task.name}.pass_at's "
                        f"k={max(task.pass_at)}")


def _check_choices(task: TaskSpec, path: str, row: dict, where: str) -> None:
    """A loglikelihood row's choices are texts and its target names one of them."""
    choices = row_choices(task, row)
    problem = choices_problem(choices)
    what = f"column {task.choices!r} (tasks.{task.name}.choices)" if isinstance(task.choices, str) \
        else f"tasks.{task.name}.choices"
    if problem:
        raise DataError(f"{path}:{where}: {what} {problem}")
    try:
        target_index(row[task.target], choices)
    except ValueError as e:
        raise DataError(f"{path}:{where}: column {task.target!r} (tasks.{task.name}.target): {e}") from None


def _messages_problem(value: Any) -> str | None:
    """Why a `messages` value is not a non-empty list of {"role": str, "content": str} objects (extra keys
    are the chat template's business), or None. A missing or null content would render an empty turn."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else _json_type(value)
        return f"must be a non-empty list of {{\"role\": ..., \"content\": ...}} messages, got {got}"
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {j}: must be an object with \"role\" and \"content\", got {_json_type(message)}"
        for key in ("role", "content"):
            if key not in message:
                return f"message {j}: has no {key!r} (keys: {', '.join(map(repr, message)) or 'none'})"
            if not isinstance(message[key], str) or (key == "role" and not message[key]):
                return f"message {j}: {key!r} must be a{' non-empty' if key == 'role' else ''} string, " \
                       f"got {_json_type(message[key])}"
    return None


def _json_type(value: Any) -> str:
    """A value's type as JSON names it (null, a string, ...), for messages about data."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)
