"""summary.parquet: per model x task, counts by status and each metric's mean with its standard error.

Metrics are aggregated per prompt first, then over prompts, so the standard error (sample std / sqrt n) is
over prompts, never over a prompt's completions:
- `score`: per prompt, the mean score of its scored completions (with n = 1, the row's score; a
  loglikelihood task's acc);
- `acc_norm` and `acc_bytes` (loglikelihood): the rows' score_norm and score_bytes (cluster/contracts/loglikelihood.py:
  normalised by the choices' characters, as lm-eval's acc_norm, and by their UTF-8 bytes, its acc_bytes);
- `pass@k` (tasks with `pass_at`): per prompt with n scored completions of which c passed (score 1),
  1 - C(n - c, k) / C(n, k) (Chen et al., 2021, the unbiased estimator); a prompt with fewer than k
  scored completions does not count towards pass@k.
- the results' per-completion `metrics` (numeric_match: strict_match and flexible_extract): per prompt, the
  mean over its completions that have the metric, as `score`.
Every metric other than `score` is a row of the `metrics` column (name, value, stderr, n).
Counts: `n` is results rows (completions: sampling.n per prompt), `n_samples` prompts (the samples the
progress line counts), `n_scored` prompts with a score; `n_ok` .. `n_error` count completions, as `n` does.
Each shard holds every completion of its prompts, so prompts are complete within the table `add` is given;
the state kept is a few numbers per metric (Chan et al.'s pairwise update), not the rows.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pyarrow as pa

from cluster.contracts.shard import STATUSES  # a results row's statuses: ok, truncated, skipped, error


METRIC = pa.struct([("name", pa.string()), ("value", pa.float64()), ("stderr", pa.float64()), ("n", pa.int64())])
SUMMARY_SCHEMA = pa.schema([
    ("model", pa.string()), ("task", pa.string()),
    ("n", pa.int64()),  # results rows: completions (sampling.n per prompt)
    ("n_samples", pa.int64()),  # prompts: the samples the progress line counts
    ("n_scored", pa.int64()),  # prompts with a score (lm-eval tasks: its documents)
    ("score", pa.float64()), ("stderr", pa.float64()), ("n_ok", pa.int64()), ("n_truncated", pa.int64()),
    ("n_skipped", pa.int64()), ("n_error", pa.int64()), ("structured_valid_rate", pa.float64()),
    ("output_tokens", pa.int64()), ("metrics", pa.list_(METRIC)),
    ("error", pa.string()),  # why the task has no score where its scoring failed (an lm-eval task's own code raised)
])
# the results columns the summary reads (cluster/contracts/results_schema.py); those an older output lacks read as null
COLUMNS = ("model", "task", "sample_id", "status", "score", "structured_valid", "output_tokens", "score_norm",
           "score_bytes", "metrics")


class _Mean:
    """Count, mean and sum of squared deviations, merged a batch at a time (Chan et al.)."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, values: list[float]) -> None:
        if not values:
            return
        n_b = len(values)
        mean_b = sum(values) / n_b
        m2_b = sum((x - mean_b) ** 2 for x in values)
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.n * n_b / n
        self.n = n

    def stderr(self) -> float | None:
        return math.sqrt(max(self.m2, 0.0) / (self.n - 1) / self.n) if self.n > 1 else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with n completions of which c passed (Chen et al., 2021, eq. 1)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class SummaryAccumulator:
    def __init__(self, pass_at: dict[str, tuple[int, ...]] | None = None):
        """`pass_at`: per task name, its k values."""
        self.pass_at = pass_at or {}
        self.groups: dict[tuple[str, str], dict] = {}

    def add(self, table: pa.Table) -> None:
        """Results rows holding every completion of their prompts (one shard's, or a whole sweep's)."""
        if table.num_rows == 0:
            return
        cols = {c: table[c].to_pylist() if c in table.column_names else [None] * table.num_rows for c in COLUMNS}
        if "sample_id" not in table.column_names:  # rows of no known sample: each its own prompt
            cols["sample_id"] = list(range(table.num_rows))
        prompts: dict[tuple, list[int]] = defaultdict(list)
        for i, key in enumerate(zip(cols["model"], cols["task"], cols["sample_id"])):
            prompts[key].append(i)
        for (model, task, _), idx in prompts.items():
            g = self._group(model, task)
            g["n"] += len(idx)
            g["n_samples"] += 1
            for i in idx:
                if cols["status"][i] in STATUSES:
                    g[cols["status"][i]] += 1
                if cols["structured_valid"][i] is not None:
                    g["n_valid"] += 1
                    g["valid"] += bool(cols["structured_valid"][i])
                g["output_tokens"] += cols["output_tokens"][i] or 0
            scores = [cols["score"][i] for i in idx if cols["score"][i] is not None]
            if scores:
                g["metrics"]["score"].add([sum(scores) / len(scores)])
                for k in self.pass_at.get(task, ()):
                    if len(scores) >= k:
                        g["metrics"][f"pass@{k}"].add([pass_at_k(len(scores), sum(s == 1.0 for s in scores), k)])
            for column, metric in (("score_norm", "acc_norm"), ("score_bytes", "acc_bytes")):
                norm = [cols[column][i] for i in idx if cols[column][i] is not None]
                if norm:
                    g["metrics"][metric].add([norm[0]])
            _add_row_metrics(g["metrics"], [cols["metrics"][i] for i in idx])

    def _group(self, model: str, task: str) -> dict:
        return self.groups.setdefault((model, task), {
            "n": 0, "n_samples": 0, "valid": 0, "n_valid": 0, "output_tokens": 0, "metrics": defaultdict(_Mean),
            **{s: 0 for s in STATUSES}})

    def table(self) -> pa.Table:
        rows = []
        for (model, task), g in sorted(self.groups.items()):
            score = g["metrics"].get("score") or _Mean()
            rows.append({"model": model, "task": task, "n": g["n"], "n_samples": g["n_samples"],
                         "n_scored": score.n,
                         "score": score.mean if score.n else None, "stderr": score.stderr(),
                         **{f"n_{s}": g[s] for s in STATUSES},
                         "structured_valid_rate": g["valid"] / g["n_valid"] if g["n_valid"] else None,
                         "output_tokens": g["output_tokens"],
                         "metrics": [{"name": name, "value": m.mean, "stderr": m.stderr(), "n": m.n}
                                     for name, m in sorted(g["metrics"].items(), key=_metric_order)
                                     if name != "score" and m.n]})
        return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)


def _add_row_metrics(metrics: dict[str, _Mean], rows: list[list[dict] | None]) -> None:
    """One prompt's per-completion `metrics`: each metric's mean over the completions that have it."""
    values: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for m in row or ():
            if m["value"] is not None:
                values[m["name"]].append(m["value"])
    for name, got in values.items():
        metrics[name].add([sum(got) / len(got)])


def _metric_order(item: tuple[str, _Mean]) -> tuple:
    name = item[0]
    return (0, int(name[5:])) if name.startswith("pass@") else (1, name)


def summarize(results: pa.Table | None, pass_at: dict[str, tuple[int, ...]] | None = None) -> pa.Table:
    """The summary of a results table (all rows at once; the sink accumulates shard by shard instead)."""
    acc = SummaryAccumulator(pass_at)
    if results is not None:
        acc.add(results)
    return acc.table()
