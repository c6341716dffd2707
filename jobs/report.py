"""`raysweep report OUTPUT`: one self-contained HTML page on a sweep's output (DESIGN §5).

The page shows, in order: what ran (sweep, spec hash, dates, versions), the score table, a timeline of
each actor starting, running and idle (jobs/report_timeline.py) with the driver's figures per run, output
throughput per actor over time, NVML memory and utilisation per actor, engine start-up by phase, failed
shards and attempts, and the rows that did not come out ok. Plots are matplotlib PNGs inlined as `data:`
URIs, so the file opens anywhere with no network and no JavaScript. Only the columns a section needs are
read; output text only for the problem rows listed, so outputs of millions of rows stay cheap.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from cluster.contracts.errors import RaysweepError
from cluster.contracts.shard import ShardState
from cluster.store.manifest import read_manifest
from jobs import report_timeline as timeline


MAX_ROWS = 200  # problem rows listed on the page; the total is always stated
TEXT_CHARS = 200  # output text shown per problem row
PROBLEM_COLUMNS = ["model", "task", "shard_id", "sample_id", "status", "finish_reason", "prompt_tokens",
                   "output_tokens", "error", "output_text"]
SUMMARY_COLUMNS = ["model", "task", "n", "n_scored", "score", "stderr", "n_ok", "n_truncated", "n_skipped",
                   "n_error", "structured_valid_rate", "output_tokens", "metrics"]
ACTOR_COLUMNS = ["actor_id", "reason", "model", "profile", "engine", "node_ip", "gpu_name", "cuda_graphs",
                 "graph_mode", "fallback_reason"]
STARTUP_COLUMNS = ["startup_s", "process_s", "imports_s", "waiting_s", "engine_init_s", "load_s", "compile_s",
                   "graph_capture_s", "warmup_s", "first_token_s"]
# requested_at -> ready_at step by step; a later start of an actor has no process, imports or waiting step
STARTUP_PHASES = ("process_s", "imports_s", "waiting_s", "engine_init_s", "warmup_s")
OLD_STARTUP_PHASES = ("load_s", "compile_s", "graph_capture_s")  # outputs written before startup_s
RUN_FIGURES = ["ray_start_s", "planning_s", "first_result_s", "last_result_s", "wall_s"]  # manifest `runs`
CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top;white-space:pre-wrap}th{background:#eee}
td{font-variant-numeric:tabular-nums}.note{background:#fff4d6;border-left:4px solid #e0a800;padding:6px 10px}
dt{font-weight:bold;float:left;clear:left;width:9em}dd{margin-left:10em}img{max-width:100%}"""


class ReportError(RaysweepError, ValueError):
    """The output cannot be reported on; the message names the file."""


def write_report(output: str, out: str | None = None, max_rows: int = MAX_ROWS) -> Path:
    """Render the report of the sweep output at `output` into `out` (default OUTPUT/report.html)."""
    root = Path(output)
    page = render(root, load_manifest(root), max_rows)
    path = Path(out) if out else root / "report.html"
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"report {path}: cannot write: {e}") from None
    return path


def load_manifest(root: Path) -> dict:
    if not root.is_dir():
        raise ReportError(f"output {root}: no such directory (expected a sweep's output, holding manifest.json)")
    try:
        manifest = read_manifest(str(root))  # with the commits journaled since, if the sweep is running or died
    except FileNotFoundError:
        raise ReportError(f"output {root}: no manifest.json, so not a raysweep sweep output") from None
    except (OSError, ValueError) as e:
        raise ReportError(f"output {root}/manifest.json: unreadable: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), dict):
        raise ReportError(f"output {root}/manifest.json: no `shards` mapping, so not a raysweep manifest")
    return manifest


def render(root: Path, manifest: dict, max_rows: int = MAX_ROWS) -> str:
    labels = _actor_labels(root)
    body = "\n".join([_header(root, manifest), _scores(root), _timeline(root, manifest, labels),
                      _throughput(root, labels), _gpu(root, labels), _startup(root, labels),
                      _failures(root, manifest), _problem_rows(root, manifest, max_rows)])
    title = html.escape(f"raysweep report: {manifest.get('sweep', root.name)}")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


# -- sections ---------------------------------------------------------------------------------------
def _header(root: Path, manifest: dict) -> str:
    states = Counter(s.get("state") for s in manifest["shards"].values())
    versions = manifest.get("versions") or {}
    facts = {"output": str(root), "spec hash": manifest.get("spec_hash"), "created": manifest.get("created_at"),
             "finished": manifest.get("finished_at") or "not finished",
             "shards": f"{states[ShardState.COMMITTED]} committed, {states[ShardState.FAILED]} failed, "
                       f"{states[ShardState.PENDING]} pending",
             "versions": ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(versions.items()))}
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(_fmt(v))}</dd>" for k, v in facts.items())
    return f"<h1>{html.escape('raysweep report: ' + str(manifest.get('sweep')))}</h1>\n<dl>{items}</dl>"


def _scores(root: Path) -> str:
    summary = _read(root / "summary.parquet", SUMMARY_COLUMNS)
    if summary is None:
        return _section("Scores", "scores", _note("No summary.parquet: the sweep has not reached its end."))
    rows = [[r["model"], r["task"], _score(r["score"], r["stderr"]), r["n"], r["n_scored"], r["n_ok"],
             r["n_truncated"], r["n_skipped"], r["n_error"], _percent(r["structured_valid_rate"]),
             r["output_tokens"], metrics_text(r["metrics"])] for r in summary.to_pylist()]
    headers = ["model", "task", "score ± stderr", "n", "scored", "ok", "truncated", "skipped", "error",
               "structured valid", "output tokens", "other metrics"]
    return _section("Scores", None, _table(headers, rows, "scores"))


def _timeline(root: Path, manifest: dict, labels: dict) -> str:
    runs = _runs(root, manifest)
    starts = _rows(root / "telemetry/actors.parquet", ["actor_id", "model", "requested_at", "ready_at", "process_s",
                                                       "imports_s", "waiting_s"])
    shards = _rows(root / "telemetry/shards.parquet", ["actor_id", "model", "started_at", "finished_at"])
    t0 = runs[-1]["started_at"] if runs else timeline.earliest(starts, shards)
    lanes = [] if t0 is None else timeline.lanes(starts, shards, t0)
    if runs:  # telemetry is appended run after run: the actors of the last run are drawn
        lanes = [lane for lane in lanes if lane.first >= 0]
    notes = "".join(_note(n) for n in timeline.notes(starts, runs))
    if not lanes:
        return _section("Timeline", "timeline", _note("Nothing to draw: no engine start or shard attempt in "
                                                      "telemetry has its times.") + notes + _runs_table(runs))
    origin = "the last run's driver start" if runs else "the first recorded event"
    fig = timeline.draw(lanes, labels, timeline.run_markers(runs[-1]) if runs else {},
                        f"seconds since {t0:%Y-%m-%d %H:%M:%S} UTC ({origin})")
    n_starts, rows = Counter(r["actor_id"] for r in starts), []
    for lane in lanes:
        f = lane.seconds()
        rows.append([labels.get(lane.actor_id, lane.actor_id), n_starts[lane.actor_id], f["starting"],
                     f["waiting"], f["running"], f["idle"], _percent(f["idle_share"])])
    table = _table(["actor", "engine starts", "starting (s)", "of which waiting for a model (s)", "running (s)",
                    "idle (s)", "idle share"], rows, "timeline-actors")
    return _section("Timeline", "timeline", notes + _png(fig, "when each actor was starting, running shards and "
                                                             "idle") + table + _runs_table(runs))


def _runs_table(runs: list[dict]) -> str:
    if not runs:
        return ""
    rows = [[i, r["started_at"]] + [None if r.get(k) is None else float(r[k]) for k in RUN_FIGURES]
            for i, r in enumerate(runs, 1)]
    return ("<h3>Runs (manifest.json): seconds from the driver's start</h3>"
            + _table(["run", "driver started (UTC)", "Ray up", "planning done", "first result", "last result",
                      "wall"], rows, "runs"))


def _throughput(root: Path, labels: dict) -> str:
    t = _read(root / "telemetry/shards.parquet", ["actor_id", "finished_at", "output_tok_per_s", "error"])
    if t is None:
        return _section("Throughput", "throughput", _note("No telemetry/shards.parquet."))
    t = t.filter(pc.and_(pc.is_null(t["error"]), pc.and_(pc.is_valid(t["output_tok_per_s"]),
                                                          pc.is_valid(t["finished_at"]))))
    if t.num_rows == 0:
        return _section("Throughput", "throughput", _note("No shard finished, so no throughput was measured."))
    fig = Figure(figsize=(11, 3.8))
    ax = fig.add_subplot()
    for actor, part in _by_actor(t):
        part = part.sort_by("finished_at")
        ax.plot(_times(part["finished_at"]), part["output_tok_per_s"].to_numpy(), marker="o",
                label=labels.get(actor, actor))
    _time_axis(ax, "shard finished (UTC)")
    ax.set_ylabel("output tokens/s per shard")
    ax.legend(fontsize=8)
    return _section("Throughput per actor", "throughput", _png(fig, "output tokens per second per shard, by actor"))


def _gpu(root: Path, labels: dict) -> str:
    t = _read(root / "telemetry/gpu.parquet", ["actor_id", "time", "mem_used_mib", "util_pct"])
    if t is None:
        return _section("GPU memory and utilisation", "gpu", _note(
            "No NVML readings: telemetry/gpu.parquet is absent (no actor read NVML: no NVIDIA GPU or "
            "driver where they ran, or no shard finished). Nothing is plotted rather than zeros."))
    readings = [(c, t.filter(pc.and_(pc.is_valid(t["time"]), pc.is_valid(t[c]))))
                for c in ("mem_used_mib", "util_pct")]
    if all(part.num_rows == 0 for _, part in readings):
        return _section("GPU memory and utilisation", "gpu", _note(
            "No NVML readings: telemetry/gpu.parquet holds no memory or utilisation values. "
            "Nothing is plotted rather than zeros."))
    fig = Figure(figsize=(11, 6))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, (column, part), ylabel in zip(axes, readings, ("memory used (MiB)", "GPU utilisation (%)")):
        for actor, mine in _by_actor(part):  # null readings were dropped above: a gap, never a zero
            mine = mine.sort_by("time")
            ax.plot(_times(mine["time"]), mine[column].to_numpy(), label=labels.get(actor, actor))
        ax.set_ylabel(ylabel)
        if part.num_rows == 0:
            ax.text(0.5, 0.5, "no readings", transform=ax.transAxes, ha="center")
    _time_axis(axes[1], "NVML reading (UTC)")
    axes[0].legend(fontsize=8)
    return _section("GPU memory and utilisation", "gpu", _png(fig, "GPU memory and utilisation per actor (NVML)"))


def _startup(root: Path, labels: dict) -> str:
    t = _read(root / "telemetry/actors.parquet", ACTOR_COLUMNS + STARTUP_COLUMNS)
    if t is None:
        return _section("Engine start-up", "startup", _note("No telemetry/actors.parquet."))
    starts = t.to_pylist()
    names = [f"{labels.get(r['actor_id'], r['actor_id'])} #{i}" + (f" ({r['reason']})" if r["reason"] else "")
             for i, r in enumerate(starts)]
    tables = (_table(["engine start"] + ACTOR_COLUMNS[1:], [[n] + [r[c] for c in ACTOR_COLUMNS[1:]]
                                                            for n, r in zip(names, starts)], "engine-starts")
              + _table(["engine start"] + STARTUP_COLUMNS, [[n] + [r[c] for c in STARTUP_COLUMNS]
                                                           for n, r in zip(names, starts)], "startup-phases"))
    phases = _phase_widths(starts)
    if not phases:
        return _section("Engine start-up", "startup", tables)
    fig = Figure(figsize=(11, 1.2 + 0.35 * len(starts)))
    ax = fig.add_subplot()
    left = np.zeros(len(starts))
    for phase, width in phases.items():  # an unmeasured phase (NaN) adds no bar, not a zero-width "measurement"
        ax.barh(names, np.nan_to_num(width), left=left, label=phase)
        left += np.nan_to_num(width)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _section("Engine start-up", "startup", _png(fig, "engine start-up time by phase") + tables)


def _phase_widths(starts: list[dict]) -> dict[str, np.ndarray]:
    """Seconds per start-up phase, in order, NaN where not measured; a phase no start measured is left out.
    Outputs written before startup_s have only load, compile and graph capture."""
    def column(c):
        return np.array([np.nan if r[c] is None else r[c] for r in starts], dtype=float)

    if all(r["startup_s"] is None for r in starts):
        widths = {c.removesuffix("_s"): column(c) for c in OLD_STARTUP_PHASES}
    else:
        widths = {c.removesuffix("_s"): column(c) for c in STARTUP_PHASES}
        rest = column("startup_s") - np.nansum(np.vstack(list(widths.values())), axis=0)
        widths["rest of startup_s (in no measured step)"] = np.where(rest > 0, rest, np.nan)
        widths["first token (after ready)"] = column("first_token_s")
    return {k: v for k, v in widths.items() if not np.isnan(v).all()}


def _failures(root: Path, manifest: dict) -> str:
    failed = sorted((sid, s) for sid, s in manifest["shards"].items() if s.get("state") == ShardState.FAILED)
    shards = (_table(["shard", "attempts", "errors"],
                     [[sid, s.get("attempts"), "\n".join(f"{i}: {e}" for i, e in enumerate(s.get("errors", []), 1))]
                      for sid, s in failed], "failed-shards")
              if failed else "<p>No shard failed.</p>")
    t = _read(root / "telemetry/shards.parquet", ["shard_id", "attempt", "actor_id", "error"])
    attempts = [] if t is None else t.filter(pc.is_valid(t["error"])).to_pylist()
    retried = (_table(["shard", "attempt", "actor", "error"], [list(r.values()) for r in attempts])
               if attempts else "<p>No attempt failed.</p>")
    return _section("Failed shards", "failures", shards + "<h3>Failed attempts (telemetry/shards.parquet)</h3>"
                    + retried)


def _problem_rows(root: Path, manifest: dict, max_rows: int) -> str:
    files = sorted(root / s["file"] for s in manifest["shards"].values() if s.get("state") == ShardState.COMMITTED)
    for f in files:
        if not f.is_file():
            raise ReportError(f"output {root}/manifest.json: committed shard file {f} is missing")
    if not files:
        return _section("Rows not ok", "rows", "<p>No committed result shards.</p>")
    dataset = ds.dataset([str(f) for f in files], format="parquet")
    not_ok = pc.field("status") != "ok"
    counts = Counter(dataset.to_table(columns=["status"], filter=not_ok)["status"].to_pylist())
    total = sum(counts.values())
    if total == 0:
        return _section("Rows not ok", "rows", "<p>Every row came out ok.</p>")
    head = dataset.head(max_rows, columns=PROBLEM_COLUMNS, filter=not_ok).to_pylist()
    for r in head:
        text = r["output_text"] or ""
        r["output_text"] = text[:TEXT_CHARS] + ("…" if len(text) > TEXT_CHARS else "")
    by_status = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
    intro = (f"<p>{total} rows did not come out ok ({html.escape(by_status)}); "
             f"{'all are' if len(head) == total else f'the first {len(head)} are'} listed.</p>")
    return _section("Rows not ok", "rows", intro + _table(PROBLEM_COLUMNS, [list(r.values()) for r in head],
                                                           "problem-rows"))


# -- reading ----------------------------------------------------------------------------------------
def _read(path: Path, columns: list[str]) -> pa.Table | None:
    """The named columns of a Parquet file, or None where there is no file. A column the file lacks is
    all null: telemetry tables are built from dicts, so e.g. shards.parquet of a sweep whose every
    attempt failed holds only shard_id, attempt and error."""
    if not path.is_file():
        return None
    try:
        have = set(pq.read_schema(path).names)
        table = pq.read_table(path, columns=[c for c in columns if c in have])
    except (OSError, pa.ArrowInvalid) as e:  # torn or replaced: say which file, in one line
        raise ReportError(f"output {path.parent if path.name == 'summary.parquet' else path.parent.parent}: "
                          f"{path.name if path.name == 'summary.parquet' else 'telemetry/' + path.name} cannot be "
                          f"read ({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]}); the sweep's next "
                          "run writes it again") from None
    for c in columns:
        if c not in have:
            table = table.append_column(c, pa.nulls(table.num_rows))
    return table.select(columns)


def _rows(path: Path, columns: list[str]) -> list[dict]:
    t = _read(path, columns)
    return [] if t is None else t.to_pylist()


def _runs(root: Path, manifest: dict) -> list[dict]:
    try:
        return timeline.parse_runs(manifest.get("runs"))
    except ValueError as e:
        raise ReportError(f"output {root}/manifest.json: {e}") from None


def _actor_labels(root: Path) -> dict[str, str]:
    """Actor id -> "model · first 8 hex digits of the id", for legends."""
    t = _read(root / "telemetry/actors.parquet", ["actor_id", "model"])
    rows = [] if t is None else t.to_pylist()
    return {r["actor_id"]: f"{r['model']} · {str(r['actor_id'])[:8]}" for r in rows if r["actor_id"]}


def _by_actor(t: pa.Table):
    for actor in sorted(a for a in pc.unique(t["actor_id"]).to_pylist() if a is not None):
        yield actor, t.filter(pc.equal(t["actor_id"], actor))


def _times(column: pa.ChunkedArray) -> np.ndarray:
    """Timestamps (UTC) as datetime64; float columns are seconds since the epoch (NVML's time.time())."""
    if pa.types.is_timestamp(column.type):
        return pc.cast(column, pa.timestamp("us")).to_numpy()
    return (column.to_numpy() * 1e6).astype("datetime64[us]")


# -- HTML -------------------------------------------------------------------------------------------
def _section(title: str, section_id: str | None, body: str) -> str:
    attr = f' id="{section_id}"' if section_id else ""
    return f"<section{attr}><h2>{html.escape(title)}</h2>\n{body}</section>"


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def _table(headers: list[str], rows: list[list], table_id: str | None = None) -> str:
    attr = f' id="{table_id}"' if table_id else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>\n" for row in rows)
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"


def _png(fig: Figure, alt: str) -> str:
    # figures are built with Figure, not pyplot: no global figure state, and Agg renders the PNG
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _time_axis(ax, label: str) -> None:
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    ax.set_xlabel(label)


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    return str(v)


def metrics_text(metrics: list | None) -> str:
    """A summary row's other metrics (acc_norm, pass@k) as `name value ± stderr`, comma-separated."""
    return ", ".join(f"{m['name']} {_score(m['value'], m['stderr'])}" for m in metrics or ())


def _score(score: float | None, stderr: float | None) -> str:
    if score is None:
        return "—"
    return f"{score:.3f}" if stderr is None else f"{score:.3f} ± {stderr:.3f}"


def _percent(rate: float | None) -> str:
    return "—" if rate is None else f"{100 * rate:.1f}%"
