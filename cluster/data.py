"""Task data: JSONL or Parquet rows in, sample ids and rendered prompts out.

Every problem with a data file is raised as `DataError` naming the file and, for JSONL, the line.
Prompts are rendered once per model (chat templates differ between models) by `render_prompts`.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from typing import Any

from cluster.spec import SweepSpec, TaskSpec


class DataError(ValueError):
    """A task's data cannot be used; the message names the file and the line or column."""


@dataclass(frozen=True)
class TaskData:
    task: TaskSpec
    path: str
    sample_ids: list[str]
    rows: list[dict]  # one dict per sample, as read

    def targets(self) -> list[Any]:
        return [row.get(self.task.target) for row in self.rows] if self.task.target else [None] * len(self.rows)


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
    path = spec.data_path(task)
    try:
        template_fields(task.prompt or "")
    except ValueError as e:
        raise DataError(f"{spec.source}: tasks.{task.name}.{e}") from None
    rows, lines = _read_rows(path)
    if not rows:
        raise DataError(f"{path}: task {task.name!r} has no rows")
    _check_columns(task, path, rows, lines)
    ids = [str(row[task.id_column]) if task.id_column else str(i) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, sid in enumerate(ids):
        if sid in seen:
            raise DataError(f"{path}:{_where(lines, i)}: duplicate sample id {sid!r} "
                            f"(first at {_where(lines, seen[sid])})")
        seen[sid] = i
    return TaskData(task=task, path=path, sample_ids=ids, rows=rows)


def render_prompts(data: TaskData, tokenizer) -> tuple[list[str], bool]:
    """Prompt texts, and whether the tokenizer should add its special tokens (False for chat-rendered
    text, whose template already holds them)."""
    task = data.task
    if task.messages is None and not task.chat:
        return [task.prompt.format(**row) for row in data.rows], True
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"task {task.name}: the model's tokenizer has no chat template")
    prompts = []
    for i, row in enumerate(data.rows):
        messages = list(row[task.messages]) if task.messages else [{"role": "user", "content": task.prompt.format(**row)}]
        if task.system is not None:
            messages.insert(0, {"role": "system", "content": task.system})
        try:
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as e:  # a template error must stop the sweep, never change the prompt quietly
            raise DataError(f"{data.path}: sample {data.sample_ids[i]}: chat template failed: {e}") from None
    return prompts, False


def _read_rows(path: str) -> tuple[list[dict], list[int] | None]:
    """Rows and, for JSONL, the 1-based line number of each row."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist(), None
        except FileNotFoundError:
            raise DataError(f"{path}: no such data file") from None
        except Exception as e:  # pyarrow's ArrowInvalid etc.: say which file
            raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    rows, lines = [], []
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
                lines.append(n)
    except FileNotFoundError:
        raise DataError(f"{path}: no such data file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text: {e}") from None
    return rows, lines


def _check_columns(task: TaskSpec, path: str, rows: list[dict], lines: list[int] | None) -> None:
    needed = {c: f"prompt placeholder {{{c}}}" for c in template_fields(task.prompt or "")}
    for field_name in ("messages", "target", "id_column"):
        column = getattr(task, field_name)
        if column is not None:
            needed[column] = f"`{field_name}` column"
    for i, row in enumerate(rows):
        for column, why in needed.items():
            if column not in row:
                raise DataError(f"{path}:{_where(lines, i)}: missing column {column!r} "
                                f"(the task {task.name!r} needs it as its {why})")


def _where(lines: list[int] | None, i: int) -> str:
    return f"{lines[i]}" if lines else f"row {i}"
