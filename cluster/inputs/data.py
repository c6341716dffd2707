"""Task data: JSONL or Parquet rows in, sample ids and rendered prompts out.

Every problem with a data file is raised as `DataError` naming the file and, for JSONL, the line:
bytes that are not UTF-8, a line that is not a JSON object, a lone surrogate ("\\ud800", which Python's
JSON parser accepts), a missing column, a null where the task needs a value (the id column, a prompt
placeholder's column, the target column: a null answer would be scored 0, a null question rendered as
"None"), a `messages` value that is not a non-empty list of {role, content} strings, a duplicate id, a
row the prompt template or a code_exec program template cannot render. A UTF-8 byte order mark at the
start of a JSONL file is skipped.
Prompts are rendered once per model (chat templates differ between models) by `render_prompts`; planning reads
each batch with its prompts, targets and extras at once (`TaskData.rendered`).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from cluster.inputs.data_files import DataError, _first_line, _read_batches, content_hash
from cluster.contracts.spec import SweepSpec, TaskSpec
from cluster.contracts.loglikelihood import choices_problem, row_choices, target_index
from cluster.contracts.task_spec import COMPLETION, template_fields


RENDER_ERRORS = (KeyError, IndexError, ValueError, TypeError, AttributeError)  # what str.format raises on a row


@dataclass(frozen=True)
class RowBatch:
    ids: list[str]  # sample ids
    rows: list[dict]  # one dict per sample, as read
    where: list[str]  # "LINE" (JSONL, 1-based) or "row N" (Parquet), for error messages


@dataclass(frozen=True)
class RenderedBatch:
    """A batch as planning stages it: each row's prompt rendered for one model, its target and its extras."""
    rows: RowBatch
    prompts: list[str]
    add_special: bool  # whether the tokenizer adds its special tokens (False for chat-rendered text)
    targets: list  # each row's reference answer (None where the task has no target column)
    extras: list[dict | None]  # what each row carries beside its prompt and target (`row_extra`)


@dataclass(frozen=True)
class TaskData:
    """A task's data file, checked: every row parses, has the columns the task reads and a unique id.
    Rows are not held: `batches()` streams them again (once per model, whose chat template differs)."""
    task: TaskSpec
    path: str
    n_rows: int
    digest: str | None = None  # the file's content hash, taken before the checks read it

    def check_unchanged(self) -> None:
        """DataError where the file's bytes are not those the checks read: planning read it again, and a
        file rewritten in between would be planned unchecked (rows twice, rows missing a column)."""
        if self.digest is not None and content_hash(self.path) != self.digest:
            raise DataError(f"{self.path}: changed while the sweep read it (after its checks, before task "
                            f"{self.task.name}'s shards were cut); nothing of the task ran: run the sweep again")

    @contextmanager
    def read_again(self) -> Iterator[None]:
        """Planning reads the file again. The checks rendered every row, so a row that no longer renders there
        (a column gone, a line that no longer parses) means the file changed after them: that is what is said
        (`check_unchanged`), not a KeyError from the planner's thread. Where the file is the same, the error is
        raised as it came."""
        try:
            yield
        except (DataError, *RENDER_ERRORS):
            self.check_unchanged()
            raise

    def batches(self) -> Iterator[RowBatch]:
        for rows, where, first in _read_batches(self.path):
            yield RowBatch(_ids(self.task, rows, first), rows, where)

    def rendered(self, tokenizer) -> Iterator[RenderedBatch]:
        """The batches again, each with its prompts rendered for the model of `tokenizer` (`render_prompts`), its
        targets and extras. A replay task's (`tokenizer` None: no model runs it) is its template as written."""
        for batch in self.batches():
            if self.task.replay is not None:
                prompts, add_special = [self.task.prompt.format(**row) if self.task.prompt else ""
                                        for row in batch.rows], True
            else:
                prompts, add_special = render_prompts(self.task, batch, tokenizer, self.path)
            yield RenderedBatch(batch, prompts, add_special, [self.target_of(row) for row in batch.rows],
                                [self.extra_of(row) for row in batch.rows])

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


def data_hashes(spec: SweepSpec) -> dict[str, dict]:
    """Per task, its data file and that file's content hash (the manifest keeps them); for an lm-eval task, also
    the hash of its documents (its rows file holds the requests, not the documents' labels)."""
    return {task.name: _hashes(task, spec.data_path(task), content_hash(spec.data_path(task))) for task in spec.tasks}


def checked_hashes(data: list["TaskData"]) -> dict[str, dict]:
    """`data_hashes` of data `check_inputs` already read (its hashes taken in that read): what a run's manifest
    records and checks a resume against (cluster/store/manifest.py)."""
    return {d.task.name: _hashes(d.task, d.path, d.digest) for d in data}


def generation_budget(data) -> int:
    """The most new tokens a sweep asks of each model: rows x max_tokens x completions per prompt over its
    generation tasks (`data`: TaskData of each task). Log-likelihood and replayed tasks generate none."""
    return sum(d.n_rows * d.task.sampling.max_tokens * d.task.sampling.n for d in data
               if not d.task.loglikelihood and d.task.replay is None)


def _hashes(task: TaskSpec, path: str, digest: str) -> dict:
    documents = task.lm_eval.documents if task.lm_eval is not None else None
    return {"path": path, "hash": digest, **({"documents": documents} if documents is not None else {})}


def load_task(spec: SweepSpec, task: TaskSpec) -> TaskData:
    """Check the task's data file in one streaming pass, keeping 8 bytes per row: every row parses, holds
    the task's columns and renders its prompt template; duplicate ids are found from 64-bit id hashes
    (sorted at the end) and confirmed on a second read. Cheap (no tokenizer): it runs before Ray starts."""
    path = spec.data_path(task)
    try:
        template_fields(task.prompt or "")
    except ValueError as e:
        raise DataError(f"{spec.source}: tasks.{task.name}.{e}") from None
    digest = content_hash(path)  # before the checks' read: planning's later read is compared with it
    hashes, n, needed = [], 0, task.columns_read()
    program_columns = task.scorer.columns() if task.scorer is not None else []  # parsed once, not per row
    for rows, where, first in _read_batches(path):
        _check_columns(task, needed, path, rows, where)
        _check_rendering(task, program_columns, path, rows, where)
        hashes.append(np.fromiter((_id_hash(sid) for sid in _ids(task, rows, first)), dtype=np.uint64, count=len(rows)))
        n += len(rows)
    if n == 0:
        raise DataError(f"{path}: task {task.name!r} has no rows")
    ordered = np.sort(np.concatenate(hashes))
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(same):
        _raise_duplicate(task, path, {int(h) for h in ordered[same]})
    return TaskData(task=task, path=path, n_rows=n, digest=digest)


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


def _check_rendering(task: TaskSpec, program_columns: list[str], path: str, rows: list[dict], where: list[str]) -> None:
    """Render the prompt template on every row, as planning will, and a code_exec program as scoring will
    (with an empty completion, which a model may return; `program_columns`: ScorerSpec.columns): a format spec or
    an index the row's value does not take ("{question:d}" on text, "{question[999]}", "{meta[fn]}" where a row's
    meta has no fn) fails here, naming the row, not at scoring time after the GPU work."""
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
            program.format(**{c: row[c] for c in program_columns}, **{COMPLETION: ""})
        except RENDER_ERRORS as e:
            raise DataError(f"{path}:{w}: tasks.{task.name}.scorer.program {program!r} cannot be rendered from "
                            f"this row and an empty completion: {type(e).__name__}: {_first_line(e)}") from None


def _check_columns(task: TaskSpec, needed: dict[str, str], path: str, rows: list[dict], where: list[str]) -> None:
    """Every column the task reads (`needed`: TaskSpec.columns_read) is there and holds a value: null is refused
    in the id column, a prompt placeholder's column and the target column (a null answer is no reference to
    score against; a row without one belongs in another task); the `messages` column holds chat messages
    (`_messages_problem`)."""
    for i, row in enumerate(rows):
        for column, why in needed.items():
            if column not in row:
                raise DataError(f"{path}:{where[i]}: missing column {column!r} "
                                f"(the task {task.name!r} needs it as its {why})")
            if row[column] is None and column != task.messages:
                raise DataError(f"{path}:{where[i]}: column {column!r} is null "
                                f"(the task {task.name!r} needs a value as its {why})")
            if column == task.target and row[column] != row[column]:  # NaN: no completion can equal it
                raise DataError(f"{path}:{where[i]}: column {column!r} is NaN "
                                f"(the task {task.name!r} needs a value as its {why})")
        if task.messages is not None:
            problem = _messages_problem(row[task.messages])
            if problem:
                raise DataError(f"{path}:{where[i]}: column {task.messages!r} (tasks.{task.name}.messages) {problem}")
        if task.loglikelihood:
            _check_choices(task, path, row, where[i])
        if task.scorer is not None and task.scorer.name == "json_match" and isinstance(row.get(task.target), str):
            _check_json_target(task, path, row[task.target], where[i])
        if _scored_by_choice_set(task):
            _check_target_in_choice_set(task, path, row[task.target], where[i])
        if task.replay is not None:
            _check_replayed(task, path, row[task.replay.column], where[i])


def _check_json_target(task: TaskSpec, path: str, value: str, where: str) -> None:
    """A json_match target given as text is JSON (the scorer parses it for every completion)."""
    try:
        json.loads(value)
    except ValueError as e:
        raise DataError(f"{path}:{where}: column {task.target!r} (tasks.{task.name}.target): not JSON, which "
                        f"scorer json_match compares against: {e}") from None


def _scored_by_choice_set(task: TaskSpec) -> bool:
    """A task whose generation is one of a `structured: {choice: [...]}` set, compared whole with its target
    (`exact_match`; the `choice` scorer reads a part of it)."""
    return (task.structured is not None and task.structured.kind == "choice" and task.scorer is not None
            and task.scorer.name == "exact_match")


def _check_target_in_choice_set(task: TaskSpec, path: str, value: Any, where: str) -> None:
    """The target is one of the texts generation is held to (spaces around either aside, as the scorers compare):
    else the row scores 0 whatever the model does."""
    target = value if isinstance(value, str) else json.dumps(value)
    if target.strip() not in {c.strip() for c in task.structured.value}:
        raise DataError(f"{path}:{where}: column {task.target!r} (tasks.{task.name}.target) {target!r} is none of "
                        f"tasks.{task.name}.structured's choices {list(task.structured.value)}, which generation is "
                        "held to: scorer exact_match would give it 0 whatever the model generates")


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
