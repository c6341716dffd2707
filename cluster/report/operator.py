"""The report's operator view: when each actor was starting, running and idle (timeline.py), throughput per
actor, NVML memory and utilisation, engine start-up by phase, failed shards and attempts, and the rows that
did not come out ok. Actors are labelled by every model they ran, in order, and their id."""

from __future__ import annotations

import html
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from cluster.contracts.shard import RowStatus, ShardState
from cluster.report import timeline
from cluster.report.html_parts import note, percent, png, section, table
from cluster.report.reading import ReportError, committed, telemetry, telemetry_rows

TEXT_CHARS = 200  # output text shown per problem row
PROBLEM_COLUMNS = ["model", "task", "shard_id", "sample_id", "status", "finish_reason", "prompt_tokens",
                   "output_tokens", "error", "output_text"]
ACTOR_COLUMNS = ["actor_id", "reason", "model", "profile", "engine", "node_ip", "gpu_name", "cuda_graphs",
                 "graph_mode", "fallback_reason"]
STARTUP_COLUMNS = ["startup_s", "process_s", "imports_s", "waiting_s", "engine_init_s", "load_s", "weights_s",
                   "core_init_s", "compile_s", "profile_run_s", "graph_capture_s", "warmup_s", "first_token_s"]
# requested_at -> ready_at step by step; a later start of an actor has no process, imports or waiting step
STARTUP_PHASES = ("process_s", "imports_s", "waiting_s", "engine_init_s", "warmup_s")
OLD_STARTUP_PHASES = ("load_s", "compile_s", "graph_capture_s")  # outputs written before startup_s
RUN_FIGURES = ["ray_start_s", "planning_s", "first_result_s", "last_result_s", "wall_s"]  # manifest `runs`

# why telemetry may be missing: the sweep's actors have written none yet (the parts under telemetry/.pending, read
# with the tables, are written as shards commit)
NOT_YET = " (written as the actors start and shards commit)"


def operator_view(root: Path, manifest: dict, max_rows: int) -> str:
    labels = actor_labels(root)
    return "\n".join([_timeline(root, manifest, labels), _throughput(root, labels), _gpu(root, labels),
                      _startup(root, labels), _failures(root, manifest), _problem_rows(root, manifest, max_rows)])


def actor_labels(root: Path) -> dict[str, str]:
    """Actor id -> "every model it ran, in order · first 8 hex digits of the id", for legends: an actor that
    started on tiny and then ran small is "tiny → small · 7fdeaf60", not named by its last model alone."""
    models: dict[str, list[str]] = {}
    for r in telemetry_rows(root, "actors", ["actor_id", "model"]):
        if r["actor_id"]:
            ran = models.setdefault(r["actor_id"], [])
            if r["model"] and r["model"] not in ran:
                ran.append(r["model"])
    for r in telemetry_rows(root, "shards", ["actor_id", "model"]):
        if r["actor_id"] and r["model"] and r["model"] not in models.setdefault(r["actor_id"], []):
            models[r["actor_id"]].append(r["model"])
    return {actor: f"{' → '.join(ran) or '?'} · {actor[:8]}" for actor, ran in models.items()}


def _timeline(root: Path, manifest: dict, labels: dict) -> str:
    runs = _runs(root, manifest)
    starts = telemetry_rows(root, "actors", ["actor_id", "model", "requested_at", "ready_at", "process_s",
                                             "imports_s", "waiting_s"])
    shards = telemetry_rows(root, "shards", ["actor_id", "model", "started_at", "finished_at"])
    t0 = runs[-1]["started_at"] if runs else timeline.earliest(starts, shards)
    lanes = [] if t0 is None else timeline.lanes(starts, shards, t0)
    if runs:  # telemetry is appended run after run: the actors of the last run are drawn
        lanes = [lane for lane in lanes if lane.first >= 0]
    lanes = timeline.with_tails(lanes)
    notes = "".join(note(n) for n in timeline.notes(starts, runs))
    if not lanes:
        return section("Timeline", "timeline", note("Nothing to draw: no engine start or shard attempt in "
                                                      "telemetry has its times.") + notes + _runs_table(runs))
    origin = "the last run's driver start" if runs else "the first recorded event"
    fig = timeline.draw(lanes, labels, timeline.run_markers(runs[-1]) if runs else {},
                        f"seconds since {t0:%Y-%m-%d %H:%M:%S} UTC ({origin})")
    n_starts, lines = Counter(r["actor_id"] for r in starts), []
    for lane in lanes:
        f = lane.seconds()
        lines.append([labels.get(lane.actor_id, lane.actor_id), n_starts[lane.actor_id], f["starting"],
                     f["waiting"], f["running"], f["idle"], percent(f["idle_share"]), f["tail"]])
    actors = table(["actor", "engine starts", "starting (s)", "of which waiting for a model (s)", "running (s)",
                    "idle (s)", "idle share", "idle at the tail (s)"], lines, "timeline-actors")
    return section("Timeline", "timeline", notes + png(fig, "when each actor was starting, running shards and "
                                                            "idle") + actors + _runs_table(runs))


def _runs_table(runs: list[dict]) -> str:
    if not runs:
        return ""
    rows = [[i, r["started_at"]] + [None if r.get(k) is None else float(r[k]) for k in RUN_FIGURES]
            + [percent(r.get("tail_idle_share")), r.get("tail_splits")] for i, r in enumerate(runs, 1)]
    return ("<h3>Runs (manifest.json): seconds from the driver's start</h3>"
            + table(["run", "driver started (UTC)", "Ray up", "planning done", "first result", "last result",
                      "wall", "idle at the tail (share of GPU-seconds, as the run's tail: line)",
                      "shards cut at the tail"], rows, "runs"))


def _throughput(root: Path, labels: dict) -> str:
    t = telemetry(root, "shards", ["actor_id", "finished_at", "output_tok_per_s", "error"])
    if t is None:
        return section("Throughput", "throughput",
                       note(f"No telemetry/shards.parquet nor parts of it yet{NOT_YET}."))
    t = t.filter(pc.and_(pc.is_null(t["error"]), pc.and_(pc.is_valid(t["output_tok_per_s"]),
                                                          pc.is_valid(t["finished_at"]))))
    if t.num_rows == 0:
        return section("Throughput", "throughput", note("No shard finished, so no throughput was measured."))
    fig = Figure(figsize=(11, 3.8))
    ax = fig.add_subplot()
    for actor, part in _by_actor(t):
        part = part.sort_by("finished_at")
        ax.plot(_times(part["finished_at"]), part["output_tok_per_s"].to_numpy(), marker="o",
                label=labels.get(actor, actor))
    _time_axis(ax, "shard finished (UTC)")
    ax.set_ylabel("output tokens/s per shard")
    ax.legend(fontsize=8)
    return section("Throughput per actor", "throughput", png(fig, "output tokens per second per shard, by actor"))


def _gpu(root: Path, labels: dict) -> str:
    t = telemetry(root, "gpu", ["actor_id", "time", "mem_used_mib", "util_pct"])
    if t is None:
        return section("GPU memory and utilisation", "gpu", note(
            "No NVML readings: telemetry/gpu.parquet is absent (no actor read NVML: no NVIDIA GPU or "
            "driver where they ran, or no shard finished). Nothing is plotted rather than zeros."))
    readings = [(c, t.filter(pc.and_(pc.is_valid(t["time"]), pc.is_valid(t[c]))))
                for c in ("mem_used_mib", "util_pct")]
    if all(part.num_rows == 0 for _, part in readings):
        return section("GPU memory and utilisation", "gpu", note(
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
    return section("GPU memory and utilisation", "gpu", png(fig, "GPU memory and utilisation per actor (NVML)"))


def _startup(root: Path, labels: dict) -> str:
    t = telemetry(root, "actors", ACTOR_COLUMNS + STARTUP_COLUMNS)
    if t is None:
        return section("Engine start-up", "startup",
                       note(f"No telemetry/actors.parquet nor parts of it yet{NOT_YET}."))
    starts = t.to_pylist()
    names = [f"{labels.get(r['actor_id'], r['actor_id'])} #{i}" + (f" ({r['reason']})" if r["reason"] else "")
             for i, r in enumerate(starts)]
    tables = (table(["engine start"] + ACTOR_COLUMNS[1:], [[n] + [r[c] for c in ACTOR_COLUMNS[1:]]
                                                            for n, r in zip(names, starts)], "engine-starts")
              + table(["engine start"] + STARTUP_COLUMNS, [[n] + [r[c] for c in STARTUP_COLUMNS]
                                                           for n, r in zip(names, starts)], "startup-phases"))
    phases = _phase_widths(starts)
    if not phases:
        return section("Engine start-up", "startup", tables)
    fig = Figure(figsize=(11, 1.2 + 0.35 * len(starts)))
    ax = fig.add_subplot()
    left = np.zeros(len(starts))
    for phase, width in phases.items():  # an unmeasured phase (NaN) adds no bar, not a zero-width "measurement"
        ax.barh(names, np.nan_to_num(width), left=left, label=phase)
        left += np.nan_to_num(width)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return section("Engine start-up", "startup", png(fig, "engine start-up time by phase") + tables)


def _phase_widths(starts: list[dict]) -> dict[str, np.ndarray]:
    """Seconds per start-up phase, in order, NaN where not measured; a phase no start measured is left out.
    Outputs written before startup_s have only load, compile and graph capture. A vLLM engine's construction whose
    start-up report gave its steps is drawn as them (`_engine_steps`)."""
    def column(c):
        return np.array([np.nan if r.get(c) is None else r[c] for r in starts], dtype=float)

    if all(r["startup_s"] is None for r in starts):
        widths = {c.removesuffix("_s"): column(c) for c in OLD_STARTUP_PHASES}
    else:
        widths = {c.removesuffix("_s"): column(c) for c in STARTUP_PHASES}
        rest = column("startup_s") - np.nansum(np.vstack(list(widths.values())), axis=0)
        widths = _engine_steps(widths, column("weights_s"), column("core_init_s"))
        widths["rest of startup_s (in no measured step)"] = np.where(rest > 0, rest, np.nan)
        widths["first token (after ready)"] = column("first_token_s")
    return {k: v for k, v in widths.items() if not np.isnan(v).all()}


def _engine_steps(widths: dict[str, np.ndarray], weights: np.ndarray, core: np.ndarray) -> dict[str, np.ndarray]:
    """`widths` with engine_init split, where a start measured both vLLM steps, into what came before the weights
    (the model's config, the engine core's start), the weights and the engine core's init, in that order."""
    split = ~np.isnan(weights) & ~np.isnan(core)
    whole = widths.pop("engine_init")
    before = whole - np.where(split, weights + core, np.nan)
    steps = {"engine_init": np.where(split, np.nan, whole),
             "engine_init: before the weights (config, engine core start)": np.where(before > 0, before, np.nan),
             "engine_init: weights": np.where(split, weights, np.nan),
             "engine_init: engine core's init (compile, profile, KV cache, graphs)": np.where(split, core, np.nan)}
    at = list(widths).index("warmup")
    items = list(widths.items())
    return dict(items[:at] + list(steps.items()) + items[at:])


def _failures(root: Path, manifest: dict) -> str:
    failed = sorted((sid, s) for sid, s in manifest["shards"].items() if s.get("state") == ShardState.FAILED)
    shards = (table(["shard", "attempts", "errors"],
                     [[sid, s.get("attempts"), "\n".join(f"{i}: {e}" for i, e in enumerate(s.get("errors", []), 1))]
                      for sid, s in failed], "failed-shards")
              if failed else "<p>No shard failed.</p>")
    t = telemetry(root, "shards", ["shard_id", "attempt", "actor_id", "error"])
    attempts = [] if t is None else t.filter(pc.is_valid(t["error"])).to_pylist()
    retried = (table(["shard", "attempt", "actor", "error"], [list(r.values()) for r in attempts])
               if attempts else "<p>No attempt failed.</p>")
    return section("Failed shards", "failures", shards + "<h3>Failed attempts (telemetry/shards.parquet)</h3>"
                    + retried)


def _problem_rows(root: Path, manifest: dict, max_rows: int) -> str:
    dataset = committed(root, manifest)
    if dataset is None:
        return section("Rows not ok", "rows", "<p>No committed result shards.</p>")
    not_ok = pc.field("status") != RowStatus.OK.value
    counts = Counter(dataset.to_table(columns=["status"], filter=not_ok)["status"].to_pylist())
    total = sum(counts.values())
    if total == 0:
        return section("Rows not ok", "rows", "<p>Every row came out ok.</p>")
    head = dataset.head(max_rows, columns=PROBLEM_COLUMNS, filter=not_ok).to_pylist()
    for r in head:
        text = r["output_text"] or ""
        r["output_text"] = text[:TEXT_CHARS] + ("…" if len(text) > TEXT_CHARS else "")
    by_status = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
    intro = (f"<p>{total} rows did not come out ok ({html.escape(by_status)}); "
             f"{'all are' if len(head) == total else f'the first {len(head)} are'} listed.</p>")
    return section("Rows not ok", "rows", intro + table(PROBLEM_COLUMNS, [list(r.values()) for r in head],
                                                           "problem-rows"))



def _by_actor(t: pa.Table):
    for actor in sorted(a for a in pc.unique(t["actor_id"]).to_pylist() if a is not None):
        yield actor, t.filter(pc.equal(t["actor_id"], actor))


def _times(column: pa.ChunkedArray) -> np.ndarray:
    """Timestamps (UTC) as datetime64; float columns are seconds since the epoch (NVML's time.time())."""
    if pa.types.is_timestamp(column.type):
        return pc.cast(column, pa.timestamp("us")).to_numpy()
    return (column.to_numpy() * 1e6).astype("datetime64[us]")


def _time_axis(ax, label: str) -> None:
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    ax.set_xlabel(label)




def _runs(root: Path, manifest: dict) -> list[dict]:
    try:
        return timeline.parse_runs(manifest.get("runs"))
    except ValueError as e:
        raise ReportError(f"output {root}/manifest.json: {e}") from None
