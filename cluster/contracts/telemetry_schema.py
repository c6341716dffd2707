"""The telemetry tables under telemetry/ (docs/design.md, Telemetry): each column, its type, who fills it and when. The one
owner of these columns, as cluster/contracts/results_schema.py is of the results': the store builds every
telemetry table from `SCHEMAS` (columns in this order, a key a row leaves out is null) and refuses a key
that is not here, so a new column is added here first.

Who (`by`): actor (actors/evaluator.py, for every engine) | engine (the engine's `startup()` info:
actors/vllm_engine.py, actors/hf_engine.py, actors/fake_engine.py; null where an engine has no such figure) |
driver (cluster/schedule/commit.py) | pool (actors/pool_replica.py, a shard served by a pool replica).
When (`when`): the event that makes the row, or the column's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")
FIRST_TOKENS = "first_token"  # updates of telemetry/actors rows; folded into them, never a table on disk


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    by: str  # actor | engine | driver | pool
    when: str
    doc: str


def _c(name: str, type_: pa.DataType, by: str, when: str, doc: str) -> Column:
    return Column(name, type_, by, when, doc)


A = "per shard attempt"
SHARDS: tuple[Column, ...] = (
    _c("shard_id", pa.string(), "actor", A, "<model>/<task>/<index> (the driver's row of a failed attempt too)"),
    _c("model", pa.string(), "actor", A, "the spec's model name"),
    _c("task", pa.string(), "actor", A, "the task's name"),
    _c("attempt", pa.int64(), "actor", A, "1 for the first try of the shard, counting retries"),
    _c("actor_id", pa.string(), "actor", A, "the Ray actor that ran it"),
    _c("node_ip", pa.string(), "actor", A, "the actor's node IP"),
    _c("node_id", pa.string(), "actor", A, "the actor's Ray node id"),
    _c("gpu_name", pa.string(), "actor", A, "NVML's name of the actor's GPU; null without one"),
    _c("engine", pa.string(), "actor", A, "the engine kind (vllm | hf | fake)"),
    _c("cuda_graphs", pa.bool_(), "engine", A, "the engine runs CUDA graphs"),
    _c("graph_mode", pa.string(), "engine", A, "vLLM's CUDA graph mode (FULL_AND_PIECEWISE, FULL, NONE); null off vLLM"),
    _c("profile", pa.string(), "actor", A, "the shard's engine profile: short | long"),
    _c("chunked_prefill", pa.bool_(), "engine", A, "the engine runs chunked prefill"),
    _c("max_num_batched_tokens", pa.int64(), "engine", A, "the engine's token budget per step; null off vLLM"),
    _c("n_samples", pa.int64(), "actor", A, "rows in the shard"),
    _c("prompt_tokens", pa.int64(), "actor", A, "prompt tokens of its runnable rows"),
    _c("prompt_tokens_requested", pa.int64(), "actor", A,
       "log-likelihood: prompt tokens the engine was asked to score (context + choice, per choice); null otherwise"),
    _c("prompt_tokens_computed", pa.int64(), "actor", A,
       "log-likelihood: of those, the tokens the engine computed rather than read from its prefix cache (vLLM; "
       "the CPU engine computes them all); null otherwise"),
    _c("output_tokens", pa.int64(), "actor", A, "tokens generated"),
    _c("wall_s", pa.float64(), "actor", A, "seconds the shard ran on the engine"),
    _c("output_tok_per_s", pa.float64(), "actor", A, "output_tokens / wall_s; null for log-likelihood"),
    _c("engine_batch_mean", pa.float64(), "engine", A, "mean requests per engine step while it ran (vLLM only)"),
    _c("gpu_mem_used_max_mib", pa.float64(), "actor", A, "NVML: the most GPU memory used while it ran (MiB)"),
    _c("gpu_util_mean_pct", pa.float64(), "actor", A, "NVML: mean GPU utilisation while it ran"),
    _c("power_mean_w", pa.float64(), "actor", A, "NVML: mean power while it ran (W)"),
    _c("engine_restarts", pa.int64(), "actor", A, "profile restarts of the actor's engine so far"),
    _c("started_at", TS, "actor", A, "when the shard started on the actor"),
    _c("finished_at", TS, "actor", A, "when it finished"),
    _c("error", pa.string(), "driver", A, "why the attempt failed (the driver's row); null for one that ran"),
    _c("served_by", pa.string(), "driver", A, "actor, or pool:<replica> (set by the pool replica)"),
    _c("piece", pa.string(), "driver", A, "rows start:stop of a shard being bisected; null for a whole shard"),
    _c("pool_sequence", pa.int64(), "pool", A, "the shard's place in its pool replica's admission order"),
)

S = "per engine start"
ACTORS: tuple[Column, ...] = (
    _c("actor_id", pa.string(), "actor", S, "the Ray actor"),
    _c("node_ip", pa.string(), "actor", S, "its node IP"),
    _c("node_id", pa.string(), "actor", S, "its Ray node id"),
    _c("gpu_name", pa.string(), "actor", S, "NVML's name of its GPU; null without one"),
    _c("gpus", pa.int64(), "actor", S, "GPUs Ray gave the actor"),
    _c("gpu_ids", pa.string(), "actor", S, "their ids, comma separated"),
    _c("model", pa.string(), "actor", S, "the model the engine runs"),
    _c("engine", pa.string(), "actor", S, "the engine kind (vllm | hf | fake)"),
    _c("profile", pa.string(), "actor", S, "the engine profile: short | long"),
    _c("start_index", pa.int64(), "actor", S, "the actor's engine starts before this one"),
    _c("reason", pa.string(), "actor", S,
       "first | model (a model change) | profile (a profile restart) | weights (a model change that loaded another "
       "checkpoint of the running engine's model into it: actors/weight_swap.py)"),
    _c("restart", pa.int64(), "actor", S, "profile restarts of the actor so far"),
    _c("model_change", pa.int64(), "actor", S, "model changes of the actor so far"),
    _c("requested_at", TS, "actor", S, "when the start was asked for (the first: the actor)"),
    _c("ready_at", TS, "actor", S, "when the engine was ready"),
    _c("process_started_at", TS, "actor", S, "the actor's process start (first start only)"),
    _c("process_s", pa.float64(), "actor", S, "request -> process start (first start only)"),
    _c("imports_s", pa.float64(), "actor", S, "process start -> imports done (first start only)"),
    _c("waiting_s", pa.float64(), "actor", S, "imports done -> engine asked for (first start only)"),
    _c("startup_s", pa.float64(), "actor", S, "requested_at -> ready_at"),
    _c("first_token_s", pa.float64(), "driver", S, "ready_at -> the engine's earliest first token (folded in)"),
    _c("engine_init_s", pa.float64(), "engine", S, "the engine's construction"),
    _c("built_at", TS, "engine", S,
       "when its construction ended: an early engine's can precede its actor's request, the rest end at ready_at"),
    _c("warmup_s", pa.float64(), "engine", S, "the engine's warm-up"),
    _c("load_s", pa.float64(), "engine", S, "the engine's construction and warm-up (engine_init_s + warmup_s)"),
    _c("weights_s", pa.float64(), "engine", S,
       "vLLM: the model built and its weights loaded onto the GPU (its report's \"Model loading took\"); a "
       "`weights` row: the checkpoint's weights loaded into the running engine (any engine); null elsewhere"),
    _c("core_init_s", pa.float64(), "engine", S,
       "vLLM: the engine core's step after the weights: torch.compile, the memory profile, the KV cache, graph "
       "capture and its own warm-up (its report's \"init engine ... took\"); null elsewhere"),
    _c("compile_s", pa.float64(), "engine", S, "vLLM: torch.compile seconds; null elsewhere and uncompiled"),
    _c("profile_run_s", pa.float64(), "engine", S,
       "vLLM: the memory-profiling forward pass (its report's \"Initial profiling/warmup run took\"); null "
       "elsewhere"),
    _c("graph_capture_s", pa.float64(), "engine", S, "vLLM: CUDA graph capture seconds; null elsewhere"),
    _c("cuda_graphs", pa.bool_(), "engine", S, "the engine runs CUDA graphs"),
    _c("graph_mode", pa.string(), "engine", S, "vLLM's CUDA graph mode; null off vLLM"),
    _c("fallback_reason", pa.string(), "engine", S, "vLLM: why it fell back from CUDA graphs; null if it did not"),
    _c("chunked_prefill", pa.bool_(), "engine", S, "the engine runs chunked prefill"),
    _c("max_num_batched_tokens", pa.int64(), "engine", S, "vLLM's token budget per step; null elsewhere"),
    _c("max_num_seqs", pa.int64(), "engine", S, "the most sequences per step (hf: its batch size)"),
    _c("engine_core", pa.string(), "engine", S,
       "vLLM: how its engine core runs (forkserver | forked | spawned | in-process)"),
    _c("engine_process", pa.string(), "actor", S,
       "where the engine runs: actor (the actor's process) | host (a process forked from the run's engine host) | "
       "early (there, built before its actor asked)"),
)

G = "per NVML sample"
GPU: tuple[Column, ...] = (
    _c("time", pa.float64(), "actor", G, "the reading's time, seconds since the epoch"),
    _c("mem_used_mib", pa.float64(), "actor", G, "GPU memory used, summed over the actor's GPUs (MiB)"),
    _c("util_pct", pa.float64(), "actor", G, "GPU utilisation, the mean over its GPUs"),
    _c("power_w", pa.float64(), "actor", G, "power, summed over its GPUs (W)"),
    _c("sm_clock_mhz", pa.float64(), "actor", G, "SM clock, the mean over its GPUs"),
    _c("temp_c", pa.float64(), "actor", G, "the hottest GPU's temperature"),
    _c("actor_id", pa.string(), "actor", G, "the actor that read it"),
    _c("node_id", pa.string(), "actor", G, "its Ray node id"),
    _c("gpu_name", pa.string(), "actor", G, "NVML's name of its GPU"),
)

W = "per model switch (sleep and wake)"
SWITCHES: tuple[Column, ...] = (
    _c("actor_id", pa.string(), "actor", W, "the actor (a pool replica's) that switched"),
    _c("node_ip", pa.string(), "actor", W, "its node IP"),
    _c("gpu_name", pa.string(), "actor", W, "NVML's name of its GPU"),
    _c("engine", pa.string(), "actor", W, "the engine kind"),
    _c("switch_index", pa.int64(), "actor", W, "the actor's switches before this one"),
    _c("slept_model", pa.string(), "actor", W, "the model put to sleep"),
    _c("model", pa.string(), "actor", W, "the model woken"),
    _c("at", TS, "actor", W, "when the switch began"),
    _c("sleep_s", pa.float64(), "actor", W, "seconds to sleep"),
    _c("wake_s", pa.float64(), "actor", W, "seconds to wake"),
    _c("switch_s", pa.float64(), "actor", W, "sleep + wake"),
    _c("served_by", pa.string(), "pool", W, "pool:<replica>"),
    _c("sweep_model", pa.string(), "driver", W, "the sweep's model of the shard whose admission caused it"),
)

F = "per shard with an earlier first token on its engine start"
FIRST_TOKEN: tuple[Column, ...] = (
    _c("actor_id", pa.string(), "driver", F, "the telemetry/actors row's actor"),
    _c("start_index", pa.int64(), "driver", F, "the row's start_index"),
    _c("first_token_s", pa.float64(), "driver", F, "ready_at -> the first token seen; the earliest is kept"),
)

TABLES: dict[str, tuple[Column, ...]] = {"shards": SHARDS, "actors": ACTORS, "gpu": GPU, "switches": SWITCHES,
                                         FIRST_TOKENS: FIRST_TOKEN}
SCHEMAS: dict[str, pa.Schema] = {name: pa.schema([(c.name, c.type) for c in cols]) for name, cols in TABLES.items()}
_NAMES: dict[str, frozenset] = {name: frozenset(schema.names) for name, schema in SCHEMAS.items()}  # checked per row


def check_row(table: str, row: dict) -> None:
    """Raises ValueError for a table or key that is not in the schema."""
    names = _NAMES.get(table)
    if names is None:
        raise ValueError(f"telemetry table {table!r} is not in cluster/contracts/telemetry_schema.py")
    if not names.issuperset(row):
        unknown = [key for key in row if key not in names]
        raise ValueError(f"telemetry/{table}: key {unknown[0]!r} is not in its schema "
                         f"(cluster/contracts/telemetry_schema.py): add the column there first")


def telemetry_table(table: str, rows: list[dict]) -> pa.Table:
    """Rows of `table` with every schema column, in schema order, with its type; a key a row leaves out is null."""
    for row in rows:
        check_row(table, row)
    return pa.Table.from_pylist(rows, schema=SCHEMAS[table])


def conform(table: str, data: pa.Table) -> pa.Table:
    """A table read back (an older output's file, null-typed where a column was all null then) as the schema
    has it: schema columns in order with their types, missing ones null; columns no longer in the schema kept after."""
    schema, arrays, fields = SCHEMAS[table], [], []
    for field in schema:
        if field.name in data.column_names:
            arrays.append(data[field.name].cast(field.type))
        else:
            arrays.append(pa.chunked_array([pa.nulls(data.num_rows, field.type)], type=field.type))
        fields.append(field)
    for name in data.column_names:
        if name not in schema.names:
            arrays.append(data[name])
            fields.append(data.schema.field(name))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
