"""A shard's results scored on the driver: the actor's table in, the full results table out (columns from
cluster/contracts/results_schema.py), off the scheduler's path where scoring is slow.

1. The shard's staged rows give each sample's target, prompt tokens and extras (choices, a code_exec
   program's columns, replayed completions); a sample's values go on each of its completions' rows.
2. Per task kind:
   - loglikelihood: acc, acc_norm and acc_bytes from the rows' choice log-probabilities (cluster/contracts/loglikelihood.py);
   - code_exec: each completion's program (the template formatted over the row's columns and the
     completion, cluster/score/programs.py) runs in the sandbox pool (cluster/score/sandbox.py): the shard is
     handed back as a pending future, and the scheduler keeps dispatching while the programs run; score 1
     where it passed, 0 where not, null where its sandbox never started (exec_status error, exec_error why);
     a program whose text up to the completion's end does not compile on its own is not run: 0, failed;
   - any other scorer: a function of the output and the target (cluster/score/scorers.py), here and now,
     and, for a scorer with metrics beside its score (numeric_match: both extractions), those in `metrics`;
   - a task made from a `lm_eval:` entry: nothing here; lm-eval scores it after the sweep
     (cluster/lm_eval/scores.py).
3. Structured validity for generated rows; the table assembled by column name.
`replay_table` makes the actor's part of a replay task's shard from its data, with no engine.
"""

from __future__ import annotations

import json
from concurrent.futures import Future

import pyarrow as pa

from cluster.contracts.loglikelihood import acc, acc_bytes, acc_norm, target_index
from cluster.contracts.shard import GENERATED, RowStatus, Shard
from cluster.contracts.results_schema import actor_table, assemble
from cluster.score.scorers import metrics_for, scorer_for
from cluster.contracts.spec import SweepSpec
from cluster.contracts.structured import is_valid
from cluster.score.programs import program_of
from cluster.contracts.task_spec import TaskSpec


class ShardScorer:
    def __init__(self, spec: SweepSpec, on_sandbox=lambda isolation: None):
        """`on_sandbox(isolation)`: told which isolation applies here, as the first code_exec shard is scored
        (and again should a task with another `unsafe_fallback` get another)."""
        self.spec, self.on_sandbox = spec, on_sandbox
        self._sandbox = None  # the sandbox pool, started with the first code_exec shard
        self._told: set[str] = set()  # the isolation lines told to on_sandbox

    def submit(self, model: str, task: TaskSpec, shard: Shard, table: pa.Table) -> Future:
        """A future of the scored table: done at once unless the task runs programs (code_exec). A scorer that
        raises gives a future holding its exception: the shard fails (cluster/schedule/commit.py), the sweep goes on."""
        try:
            return self._submit(model, task, shard, table)
        except Exception as e:  # e.g. json_match on a target that is no JSON: this shard's failure alone
            failed: Future = Future()
            failed.set_exception(e)
            return failed

    def _submit(self, model: str, task: TaskSpec, shard: Shard, table: pa.Table) -> Future:
        staged = shard.source.read(shard.positions)  # [sample_id, prompt, target, truncated ids, extra]
        by_id = {r[0]: k for k, r in enumerate(staged)}
        rows = [by_id[sid] for sid in table["sample_id"].to_pylist()]  # each results row's sample
        targets = [staged[k][2] for k in rows]
        extras = [staged[k][4] or {} for k in rows]
        outputs, statuses = table["output_text"].to_pylist(), table["status"].to_pylist()
        generated = [s in GENERATED and o is not None for o, s in zip(outputs, statuses)]
        lengths = None if task.replay is not None else [int(shard.prompt_tokens[k]) for k in rows]
        n = table.num_rows
        driver = {
            "sweep": [self.spec.name] * n, "model": [model] * n, "task": [task.name] * n,
            "shard_id": [shard.shard_id] * n, "prompt_tokens": lengths,
            "structured": [task.structured.kind if task.structured else None] * n,
            "structured_valid": [_valid(task.structured, o) if g and task.structured else None
                                 for o, g in zip(outputs, generated)],
            "target": [None if t is None else t if isinstance(t, str) else json.dumps(t, sort_keys=True)
                       for t in targets],
            "score": None, "score_norm": None, "score_bytes": None, "exec_status": None, "exec_error": None,
            "metrics": None,
        }
        if task.lm_eval is not None:  # scored by lm-eval's own code once every row is in (cluster/lm_eval/scores.py)
            driver["target"] = None
        elif task.loglikelihood:
            _choice_scores(driver, table, targets, extras)
        elif task.scorer is not None and task.scorer.name == "code_exec":
            return self._programs(task, driver, table, outputs, generated, extras)
        elif task.scorer is not None:
            table = _scored(task, driver, table, outputs, targets, generated)
        done: Future = Future()
        done.set_result(assemble(table, driver))
        return done

    def _programs(self, task: TaskSpec, driver: dict, table: pa.Table, outputs: list, generated: list,
                  extras: list) -> Future:
        from cluster.score.sandbox import ExecStatus, SandboxLimits, SandboxPool, check_available

        args = task.scorer.args
        unsafe = args.get("unsafe_fallback", False)
        isolation = check_available(unsafe)  # a machine with no sandbox for this task fails here
        if isolation not in self._told:
            self._told.add(isolation)
            self.on_sandbox(isolation)
        if self._sandbox is None:
            self._sandbox = SandboxPool()
        limits = SandboxLimits(timeout_s=float(args.get("timeout_s", 10)), memory_mb=int(args.get("memory_mb", 1024)))
        built = {i: program_of(args["program"], extras[i].get("columns", {}), outputs[i])
                 for i, g in enumerate(generated) if g}
        refused = {i: why for i, (_, why) in built.items() if why}  # an open end: scored 0, not run
        todo = [i for i in built if i not in refused]
        scored: Future = Future()

        def finish(ran: Future) -> None:
            try:
                outcomes = ran.result()
                status, error, score = [None] * table.num_rows, [None] * table.num_rows, [None] * table.num_rows
                for i, outcome in zip(todo, outcomes):
                    status[i], error[i] = outcome.status.value, outcome.error
                    score[i] = None if not outcome.started else 1.0 if outcome.status is ExecStatus.PASSED else 0.0
                for i, why in refused.items():
                    status[i], error[i], score[i] = ExecStatus.FAILED.value, why, 0.0
                unrun = [i for i, outcome in zip(todo, outcomes) if not outcome.started]
                scored.set_result(assemble(_error_rows(table, unrun, error),
                                           dict(driver, score=score, exec_status=status, exec_error=error)))
            except BaseException as e:  # handed to the driver's thread, which commits or fails the shard
                scored.set_exception(e)

        if todo:
            ran = self._sandbox.submit([built[i][0] for i in todo], limits, unsafe, args.get("as_main", False))
        else:  # nothing to run: the pool answers no empty submission
            ran = Future()
            ran.set_result([])
        ran.add_done_callback(finish)
        return scored

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


def _scored(task: TaskSpec, driver: dict, table: pa.Table, outputs: list, targets: list, generated: list) -> pa.Table:
    """`score` of each generated row, and its `metrics` where the scorer has them; a row a scorer raised on
    becomes an error row, with neither."""
    failed, name, n = {}, task.scorer.name, table.num_rows
    scorer, extra = scorer_for(task), metrics_for(task)
    todo = [(i, o, t) for i, (o, t, g) in enumerate(zip(outputs, targets, generated)) if g]
    scores = {i: _row_score(scorer, o, t, i, failed, name) for i, o, t in todo}
    if extra is not None:
        metrics = {i: _row_score(extra, o, t, i, failed, name) for i, o, t in todo if i not in failed}
        driver["metrics"] = [None if i in failed else metrics.get(i) for i in range(n)]
    driver["score"] = [None if i in failed else scores.get(i) for i in range(n)]
    return _error_rows(table, sorted(failed), failed)


def _row_score(scorer, output: str, target, row: int, failed: dict, name: str):
    """One row's score (or metrics); a scorer that raises on it (a RecursionError on JSON nested thousands deep, an
    overflow, ...) makes that row an error row with the reason, and its neighbours are scored."""
    try:
        return scorer(output, target)
    except Exception as e:  # any scorer's failure on one row is that row's, never the shard's
        failed[row] = f"scorer {name} raised {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        return None


def _valid(structured, output: str) -> bool | None:
    """Whether the output satisfies the structured spec; None where checking it cannot finish (JSON nested
    thousands deep exhausts the recursion limit); any other error is a bug and fails the shard."""
    try:
        return is_valid(structured, output)
    except RecursionError:
        return None


def _error_rows(table: pa.Table, rows: list[int], errors) -> pa.Table:
    """Rows that could not be scored are error rows: a program that never ran (its sandbox did not start), or
    a scorer that raised on the row. The task's fail_on_error judges them (cluster/schedule/commit.py), the
    summary counts them, and they are not scored as wrong."""
    if not rows:
        return table
    status, error = table["status"].to_pylist(), table["error"].to_pylist()
    for i in rows:
        why = errors[i]
        status[i], error[i] = RowStatus.ERROR.value, why if why.startswith("scorer ") else \
            f"code_exec: the program's sandbox did not start: {why}"
    table = table.set_column(table.schema.get_field_index("status"), "status", pa.array(status, pa.string()))
    return table.set_column(table.schema.get_field_index("error"), "error", pa.array(error, pa.string()))


def _choice_scores(driver: dict, table: pa.Table, targets: list, extras: list) -> None:
    """acc, acc_norm and acc_bytes of each loglikelihood row that was scored."""
    logprobs = table["choice_logprobs"].to_pylist()
    driver["score"], driver["score_norm"], driver["score_bytes"] = [], [], []
    for lps, target, extra in zip(logprobs, targets, extras):
        if lps is None:
            for column in ("score", "score_norm", "score_bytes"):
                driver[column].append(None)
            continue
        right = target_index(target, extra["choices"])
        driver["score"].append(acc(lps, right))
        driver["score_norm"].append(acc_norm(lps, extra["choices"], right))
        driver["score_bytes"].append(acc_bytes(lps, extra["choices"], right))


def replay_table(shard: Shard) -> pa.Table:
    """A replay task's shard as an actor would return it: each row's completions from its data column
    (a string, or a list: one results row per completion), status ok; nothing timed or counted."""
    rows = []
    for sample_id, prompt, _, _, extra in shard.source.read(shard.positions):
        replayed = extra["replay"]
        for c, text in enumerate([replayed] if isinstance(replayed, str) else replayed):
            rows.append({"sample_id": sample_id, "completion": c, "output_text": text, "status": RowStatus.OK.value, "prompt": prompt})
    return actor_table(rows)
