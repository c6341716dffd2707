"""The results table (docs/design.md, Output): its columns, their types, who fills each and at what grain. The one owner
of the schema: the actor builds its part from `ACTOR_SCHEMA`, the driver adds its columns by name through
`assemble`, and the sink, the summary and the report read the names here.

Grain: a results row is one completion of one sample (`completion` = 0 .. sampling.n - 1; 0 where n is 1),
so a sample's columns repeat on each of its completions. Per-choice columns (log-likelihood tasks) are lists
with one value per choice, in the order of the row's choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    by: str  # actor (the engine's side, in the actor's table) | driver (added by cluster/schedule/commit.py when scored)
    grain: str  # sample (the same on each of its completions) | completion | choice (a list, one per choice)
    doc: str


METRIC_VALUES = pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())]))

COLUMNS: tuple[Column, ...] = (
    Column("sweep", pa.string(), "driver", "sample", "the sweep's name"),
    Column("model", pa.string(), "driver", "sample", "the spec's model name (a replay task: replay.model)"),
    Column("task", pa.string(), "driver", "sample", "the task's name"),
    Column("sample_id", pa.string(), "actor", "sample", "the row's id: the id column, else its position in the file"),
    Column("shard_id", pa.string(), "driver", "sample", "<model>/<task>/<index>"),
    Column("output_text", pa.string(), "actor", "completion", "the completion (null where none was made)"),
    Column("output_tokens", pa.int32(), "actor", "completion", "tokens generated"),
    Column("finish_reason", pa.string(), "actor", "completion", "stop | length"),
    Column("status", pa.string(), "actor", "completion", "ok | truncated | skipped | error"),
    Column("latency_s", pa.float64(), "actor", "completion", "request submitted -> last token"),
    Column("ttft_s", pa.float64(), "actor", "completion", "request submitted -> first token"),
    Column("error", pa.string(), "actor", "completion", "why the row is an error row"),
    Column("prompt_tokens", pa.int32(), "driver", "sample", "the prompt's tokens (log-likelihood: the longest "
           "context + choice); null where no tokenizer measured it (replay)"),
    Column("structured", pa.string(), "driver", "sample", "the task's structured kind, if any"),
    Column("structured_valid", pa.bool_(), "driver", "completion", "the completion satisfies the structured spec"),
    Column("target", pa.string(), "driver", "sample", "the reference, as text (JSON for non-strings)"),
    Column("score", pa.float64(), "driver", "completion", "the scorer's value in [0, 1]; log-likelihood: acc"),
    Column("completion", pa.int32(), "actor", "completion", "which of the sample's sampling.n completions"),
    Column("score_norm", pa.float64(), "driver", "sample", "log-likelihood: acc_norm, lm-eval's (by the choices' "
           "characters; in outputs made before 2026-11-24, by their UTF-8 bytes)"),
    Column("choice_logprobs", pa.list_(pa.float64()), "actor", "choice",
           "log-likelihood: each choice's summed log-probability given the prompt"),
    Column("choice_greedy", pa.list_(pa.bool_()), "actor", "choice",
           "log-likelihood: whether each of the choice's tokens was the most likely one"),
    Column("exec_status", pa.string(), "driver", "completion", "code_exec: passed | failed | timeout | error"),
    Column("exec_error", pa.string(), "driver", "completion", "code_exec: the last line of the program's error"),
    Column("prompt", pa.string(), "actor", "sample", "the prompt as the engine was given it: rendered (chat "
           "template, few-shot context); log-likelihood: the context (null in outputs made before it was kept)"),
    Column("score_bytes", pa.float64(), "driver", "sample", "log-likelihood: acc_bytes, lm-eval's (by the choices' "
           "UTF-8 bytes)"),
    Column("metrics", METRIC_VALUES, "driver", "completion", "other metrics of the completion by name, beside "
           "score; numeric_match: strict_match and flexible_extract (its two extractions), whichever score uses; "
           "null for other scorers, unscored rows and outputs made before it was kept"),
)

RESULT_SCHEMA = pa.schema([(c.name, c.type) for c in COLUMNS])
ACTOR_SCHEMA = pa.schema([(c.name, c.type) for c in COLUMNS if c.by == "actor"])
DRIVER_COLUMNS = tuple(c.name for c in COLUMNS if c.by == "driver")
PER_CHOICE = tuple(c.name for c in COLUMNS if c.grain == "choice")


def actor_table(rows: list[dict]) -> pa.Table:
    """The actor's part of a shard's results; a column a row leaves out is null."""
    return pa.Table.from_pylist(rows, schema=ACTOR_SCHEMA)


def assemble(actor: pa.Table, driver: dict[str, list]) -> pa.Table:
    """The full results table, by name: the actor's columns and the driver's `driver` (every driver column;
    None for a column that is all null). A column missing or unknown is an error, not a silent shift."""
    missing = set(DRIVER_COLUMNS) - set(driver) | set(ACTOR_SCHEMA.names) - set(actor.column_names)
    unknown = set(driver) - set(DRIVER_COLUMNS)
    if missing or unknown:
        raise ValueError(f"results columns: missing {sorted(missing)}, unknown {sorted(unknown)}")
    n = actor.num_rows
    arrays = []
    for c in COLUMNS:
        if c.by == "actor":
            arrays.append(actor[c.name].cast(c.type))
        else:
            values = driver[c.name]
            arrays.append(pa.nulls(n, c.type) if values is None else pa.array(values, c.type))
    return pa.Table.from_arrays(arrays, schema=RESULT_SCHEMA)
