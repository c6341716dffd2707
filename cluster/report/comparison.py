"""The report's comparison: every model × task × metric of one or more outputs' summary.parquet, side by side.

Rows are task · metric (`score` first, then the summary's `metrics`: acc_norm, pass@k, lm-eval's metrics);
columns are the models, per output where several are compared (`raysweep report A B`). In each row:
- the best value is marked (higher is better, except metrics named as perplexities or bits per byte), unless
  every column has it;
- with several outputs, a value that differs from the first output's value of the same model by more than
  the standard error of the difference, sqrt(stderr_a^2 + stderr_b^2), is marked, with the difference.
Each cell carries its exact value and stderr as data attributes; the text rounds to three decimals.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

from cluster.report.html_parts import note, percent, png, score_text, section, table
from cluster.report.reading import read

SUMMARY_COLUMNS = ["model", "task", "n_samples", "n", "n_scored", "score", "stderr", "n_ok", "n_truncated", "n_skipped",
                   "n_error", "structured_valid_rate", "output_tokens", "metrics"]
LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "bpb")
CHART_ROWS = 40  # task rows drawn at most; the table holds them all


@dataclass(frozen=True)
class Output:
    label: str  # "" for a report on one output
    root: Path
    manifest: dict


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


def summaries(outputs: list[Output]) -> list[list[dict] | None]:
    """Each output's summary rows, or None where the sweep has not written summary.parquet yet."""
    found = []
    for out in outputs:
        t = read(out.root / "summary.parquet", SUMMARY_COLUMNS)
        found.append(None if t is None else t.to_pylist())
    return found


def values(outputs: list[Output], tables: list[list[dict] | None]):
    """(columns, rows): columns are (output index, model); rows are (task, metric) -> {column: (value, stderr)}."""
    columns: list[tuple[int, str]] = []
    rows: dict[tuple[str, str], dict] = {}
    for k, summary in enumerate(tables):
        for r in summary or ():
            if (k, r["model"]) not in columns:
                columns.append((k, r["model"]))
            metrics = ([("score", r["score"], r["stderr"])] if r["score"] is not None else []) + \
                [(m["name"], m["value"], m["stderr"]) for m in r["metrics"] or ()]
            for name, value, stderr in metrics:
                if value is not None:
                    rows.setdefault((r["task"], name), {})[(k, r["model"])] = (value, stderr)
    order = {name: i for i, name in enumerate(dict.fromkeys(t for t, _ in rows))}
    return columns, dict(sorted(rows.items(), key=lambda kv: (order[kv[0][0]], kv[0][1] != "score", kv[0][1])))


def best(metric: str, cells: dict) -> set:
    """The columns holding the row's best value, where at least two columns have one and not all are equal."""
    if len(cells) < 2:
        return set()
    pick = min if lower_is_better(metric) else max
    top = pick(v for v, _ in cells.values())
    found = {c for c, (v, _) in cells.items() if math.isclose(v, top, rel_tol=1e-12, abs_tol=1e-15)}
    return found if len(found) < len(cells) else set()


def difference(a: tuple, b: tuple) -> float | None:
    """b - a where it exceeds the standard error of the difference; None where it does not, or where a
    stderr is unknown (one prompt, or a metric with none)."""
    (va, sa), (vb, sb) = a, b
    if sa is None or sb is None:
        return None
    return vb - va if abs(vb - va) > math.sqrt(sa * sa + sb * sb) else None


def comparison(outputs: list[Output]) -> str:
    tables = summaries(outputs)
    if all(t is None for t in tables):
        return section("Models × tasks", "comparison", note("No summary.parquet: the sweep has not reached its end."))
    columns, rows = values(outputs, tables)
    notes = "".join(note(f"{o.label or o.root}: no summary.parquet yet (the sweep has not reached its end).")
                    for o, t in zip(outputs, tables) if t is None)
    several = len(outputs) > 1
    head = "".join(f"<th>{html.escape(column_label(outputs, c))}</th>" for c in columns)
    lines = []
    for (task, metric), cells in rows.items():
        top = best(metric, cells)
        tds = []
        for c in columns:
            if c not in cells:
                tds.append("<td>—</td>")
                continue
            value, stderr = cells[c]
            classes, text = [], score_text(value, stderr)
            if c in top:
                classes.append("best")
                text += " ★"
            base = (0, c[1])
            if several and c[0] > 0 and base in cells:
                delta = difference(cells[base], cells[c])
                if delta is not None:
                    classes.append("differs")
                    text += f" (Δ {delta:+.3f})"
            attrs = f' data-value="{value!r}"' + ("" if stderr is None else f' data-stderr="{stderr!r}"')
            tds.append(f'<td class="{" ".join(classes)}"{attrs}>{html.escape(text)}</td>')
        lines.append(f"<tr><td>{html.escape(task)}</td><td>{html.escape(metric)}</td>{''.join(tds)}</tr>\n")
    legend = ("<p>★ the best value of the row (lower is better for perplexities and bits per byte)"
              + ("; Δ a value that differs from the first output's same model by more than the standard error "
                 "of the difference" if several else "") + ". Values are mean ± standard error over prompts.</p>")
    body = (notes + legend + f'<table id="comparison"><thead><tr><th>task</th><th>metric</th>{head}</tr></thead>'
            f"<tbody>\n{''.join(lines)}</tbody></table>" + _chart(outputs, columns, rows)
            + _counts(outputs, tables))
    return section("Models × tasks", "comparison", body)


def column_label(outputs: list[Output], column: tuple[int, str]) -> str:
    k, model = column
    return model if len(outputs) == 1 else f"{outputs[k].label} · {model}"


def _chart(outputs: list[Output], columns: list, rows: dict) -> str:
    """Each task's first metric (its score), one bar per column with its stderr."""
    firsts: dict[str, tuple[str, dict]] = {}
    for (task, metric), cells in rows.items():
        firsts.setdefault(task, (metric, cells))
    if not firsts or not columns:
        return ""
    from matplotlib.figure import Figure

    shown = list(firsts.items())[:CHART_ROWS]
    fig = Figure(figsize=(11, 1.0 + 0.28 * len(shown) * len(columns)))
    ax = fig.add_subplot()
    height = 0.8 / len(columns)
    for j, c in enumerate(columns):
        ys, xs, errs = [], [], []
        for i, (_, (_, cells)) in enumerate(shown):
            if c in cells:
                ys.append(i + j * height)
                xs.append(cells[c][0])
                errs.append(cells[c][1] or 0.0)
        ax.barh(ys, xs, height=height, xerr=errs, capsize=2, label=column_label(outputs, c))
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(shown))],
                  [f"{task} · {metric}" for task, (metric, _) in shown])
    ax.invert_yaxis()
    ax.set_xlabel("value (bars: ± standard error)")
    ax.legend(fontsize=8, loc="lower right")
    more = f" (the first {CHART_ROWS} of {len(firsts)} tasks)" if len(firsts) > CHART_ROWS else ""
    return f"<h3>Each task's first metric{more}</h3>" + png(fig, "each task's first metric per model, with stderr")


def _counts(outputs: list[Output], tables: list) -> str:
    """The summary's counts per model × task: prompts, completions and their statuses, structured validity
    (n_samples is null in summaries written before it was kept)."""
    lines = []
    for out, summary in zip(outputs, tables):
        for r in summary or ():
            lines.append(([out.label] if len(outputs) > 1 else []) + [
                r["model"], r["task"], r["n_samples"], r["n"], r["n_scored"], r["n_ok"], r["n_truncated"], r["n_skipped"],
                r["n_error"], percent(r["structured_valid_rate"]), r["output_tokens"]])
    headers = (["output"] if len(outputs) > 1 else []) + [
        "model", "task", "prompts (n_samples)", "completions (n)", "prompts scored", "ok", "truncated", "skipped", "error",
        "structured valid", "output tokens"]
    return "<h3>Counts (summary.parquet)</h3>" + table(headers, lines, "scores")
