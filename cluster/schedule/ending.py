"""A sweep's summary, made once its shards are done and written with the run's end (cluster/store/sink.py `finish`):
every committed shard's rows summarized, with lm-eval's own scores of the sweep's `lm_eval:` tasks
(cluster/lm_eval/scores.py, which writes lm-eval's files beside it).

An output whose every shard an earlier run committed ends without Ray (cluster/schedule/run.py): the summary that
run wrote is kept as it is, where it was made from every committed shard and none of its tasks' scoring failed;
else it is made and written now, as a run's end does (a run killed between its last commit and its summary; a task
whose lm-eval scoring raised, which the same command scores again once the task is fixed).
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa

from cluster.contracts.spec import SweepSpec


def write_summary(spec: SweepSpec, sink, log: Callable[[str], None]) -> pa.Table:
    """The summary made (lm-eval's scores in it) and written with the run's end; earlier telemetry that could not be
    read, said."""
    summary = sink.finish(_scored(spec, sink, log))
    for name in sink.set_aside:
        log(f"[raysweep] {name} could not be read (torn or replaced): set aside as {name}.unreadable-*, "
            "and this run's telemetry written anew")
    return summary


def complete_summary(spec: SweepSpec, sink, log: Callable[[str], None]) -> pa.Table:
    """The summary of an output an earlier run completed: as written where it still holds, else written now."""
    written = sink.written_summary()
    if written is not None and not any(row["error"] for row in written.to_pylist()):  # a task's scoring failed
        return written
    return write_summary(spec, sink, log)


def samples_of(spec: SweepSpec, summary: pa.Table) -> int:
    """The samples (prompts) the summary's rows of the spec's tasks count; an lm-eval group's row, which sums its
    tasks' rows, is not counted again."""
    tasks = {t.name for t in spec.tasks}
    return sum(r["n_samples"] if r["n_samples"] is not None else r["n"] for r in summary.to_pylist()
               if r["task"] in tasks)


def _scored(spec: SweepSpec, sink, log: Callable[[str], None]) -> pa.Table:
    """The run's summary, with lm-eval's own scores of its `lm_eval:` tasks (cluster/lm_eval/scores.py)."""
    summary = sink.summary()
    if not any(t.lm_eval is not None for t in spec.tasks):
        return summary
    from cluster.inputs.model_files import chat_tokenizer, tokenizer_and_length
    from cluster.lm_eval.scores import scored_summary

    return scored_summary(spec, sink, summary, log, lambda: chat_tokenizer(spec.models, spec.base_dir),
                          lambda model: tokenizer_and_length(spec.model_path(model), model.engine.get("max_model_len")))
