"""The report's timeline: per actor, when it was starting an engine, running shards, or idle.

Built from telemetry rows only, as seconds since a time `t0`:
1. starting: each engine start, from `requested_at` (the driver asked for the actor, or for a new engine
   on it) to `ready_at`; a first start holds the actor's wait for a model (`waiting_s`, after its
   process start and imports), drawn hatched within it;
2. running: the union of the actor's shard attempts, `started_at` to `finished_at` (several shards are
   in flight at once, so their intervals overlap and are merged), per model;
3. idle: what neither covers between the actor's first engine being ready and its last shard's end;
4. tail: from the actor's last shard's end to the last shard's end of any actor drawn, the time it idled
   while others finished (what the run's `tail:` line and the manifest's `tail_idle_share` count, there
   weighted by GPUs).
Nothing is estimated: a start without both times is not drawn, and an actor with no timed start has no
starting figure (None, not 0); its idle time then counts from its first shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from matplotlib.figure import Figure
from matplotlib.patches import Patch

Interval = tuple[float, float]
STARTING, WAITING, IDLE = "#8c8c8c", "#bdbdbd", "#f2dca8"
# manifest `runs` figure -> marker name and line style; all are seconds since the run's driver start
RUN_MARKERS = {None: ("driver start", ":"), "planning_s": ("planning done", "--"),
               "first_result_s": ("first result", "-."), "last_result_s": ("last result", "-")}
AXES_PX = 850  # about the width of the plot area in pixels, to tell whether a model name fits on a bar


@dataclass
class Lane:
    """One actor's intervals, seconds since t0."""
    actor_id: str
    starts: list[tuple[float, float, str]] = field(default_factory=list)  # (requested, ready, model)
    waiting: list[Interval] = field(default_factory=list)  # within starts: the first start's wait for a model
    running: dict[str, list[Interval]] = field(default_factory=dict)  # model -> merged shard intervals
    idle: list[Interval] = field(default_factory=list)
    tail: float | None = None  # idle after its last shard while other actors finished theirs

    @property
    def first(self) -> float:
        return min([a for a, _, _ in self.starts] + [a for ivs in self.running.values() for a, _ in ivs])

    def seconds(self) -> dict[str, float | None]:
        """Seconds starting (of which waiting for a model), running and idle, and idle's share of the three."""
        starting = _length(merge([(a, b) for a, b, _ in self.starts])) if self.starts else None
        running = _length(merge([i for ivs in self.running.values() for i in ivs]))
        idle = _length(self.idle)
        total = (starting or 0.0) + running + idle
        return {"starting": starting, "waiting": _length(self.waiting) if self.waiting else None, "running": running,
                "idle": idle, "idle_share": idle / total if total else None, "tail": self.tail}


def earliest(starts: list[dict], shards: list[dict]) -> datetime | None:
    """The first recorded event: an engine requested or a shard started."""
    times = [utc(r["requested_at"]) for r in starts if _timed_start(r)]
    times += [utc(r["started_at"]) for r in shards if _timed_shard(r)]
    return min(times, default=None)


def lanes(starts: list[dict], shards: list[dict], t0: datetime) -> list[Lane]:
    """One lane per actor, by actor id. `starts`: telemetry/actors rows (actor_id, model, requested_at,
    ready_at, process_s, imports_s, waiting_s); `shards`: telemetry/shards rows (actor_id, model,
    started_at, finished_at). Rows without their times (failed attempts, starts written before these
    were recorded) are left out."""
    found: dict[str, Lane] = {}
    models = {r["actor_id"]: r["model"] for r in starts}  # for shards written before they named their model
    for r in filter(_timed_start, starts):
        lane = found.setdefault(r["actor_id"], Lane(r["actor_id"]))
        lane.starts.append((_since(r["requested_at"], t0), _since(r["ready_at"], t0), r["model"]))
        if None not in (r["process_s"], r["imports_s"], r["waiting_s"]):  # the steps before it are measured
            begin = lane.starts[-1][0] + r["process_s"] + r["imports_s"]
            lane.waiting.append((begin, begin + r["waiting_s"]))
    intervals: dict[str, dict[str, list[Interval]]] = {}
    for r in filter(_timed_shard, shards):
        model = r["model"] or models.get(r["actor_id"]) or "model not recorded"
        per_model = intervals.setdefault(r["actor_id"], {})
        per_model.setdefault(model, []).append((_since(r["started_at"], t0), _since(r["finished_at"], t0)))
    for actor, per_model in intervals.items():
        found.setdefault(actor, Lane(actor)).running = {m: merge(ivs) for m, ivs in sorted(per_model.items())}
    for lane in found.values():
        lane.idle = _idle(lane)
    return [found[a] for a in sorted(found)]


def with_tails(drawn: list[Lane]) -> list[Lane]:
    """Each lane's tail: from its last shard's end to the latest last shard's end among `drawn` (the lanes
    drawn: the last run's, where telemetry holds several runs)."""
    last = {lane.actor_id: max((b for ivs in lane.running.values() for _, b in ivs), default=None) for lane in drawn}
    end = max((t for t in last.values() if t is not None), default=None)
    for lane in drawn:
        lane.tail = None if last[lane.actor_id] is None else end - last[lane.actor_id]
    return drawn


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def gaps(span: Interval, covered: list[Interval]) -> list[Interval]:
    """The parts of `span` outside `covered`, which is sorted and disjoint (as `merge` returns it)."""
    begin, end = span
    out = []
    for a, b in covered:
        if a > begin:
            out.append((begin, min(a, end)))
        begin = max(begin, b)
        if begin >= end:
            break
    if begin < end:
        out.append((begin, end))
    return [(a, b) for a, b in out if b > a]


def run_markers(run: dict) -> dict[str, tuple[float, str]]:
    """Marker name -> (seconds since the run's driver start, and line style), for the figures present."""
    return {name: (0.0 if key is None else float(run[key]), style) for key, (name, style) in RUN_MARKERS.items()
            if key is None or run.get(key) is not None}


def parse_runs(runs: list[dict] | None) -> list[dict]:
    """The manifest's `runs` (absent in outputs written before it: []), `started_at` parsed."""
    try:
        return [r | {"started_at": utc(datetime.fromisoformat(r["started_at"]))} for r in runs or []]
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"`runs` is not a list of runs, each with an ISO-8601 started_at: {e!r}") from None


def notes(starts: list[dict], runs: list[dict]) -> list[str]:
    """What the timeline of this output cannot show, and why."""
    out = []
    untimed = sum(r["requested_at"] is None or r["ready_at"] is None for r in starts)
    if untimed == len(starts):
        out.append("telemetry/actors.parquet has no requested_at/ready_at (absent, or written before raysweep "
                   "recorded them): engine start-up is not drawn, and idle time counts from each actor's first shard.")
    elif untimed:
        out.append(f"{untimed} of {len(starts)} engine starts have no requested_at or ready_at; they are not drawn.")
    if not runs:
        out.append("manifest.json has no `runs` (a run is recorded when it ends: this one is running or was stopped "
                   "before its end, or the output is older than run records): no driver markers, and time counts "
                   "from the first recorded event.")
    elif len(runs) > 1:
        out.append(f"Run {len(runs)} of {len(runs)} is drawn; the actors of earlier runs are left out.")
    return out


def draw(found: list[Lane], labels: dict[str, str], markers: dict[str, tuple[float, str]], xlabel: str) -> Figure:
    """One lane per actor (labelled from `labels`), running bars coloured by model, `markers` as vertical lines."""
    fig = Figure(figsize=(11, 1.4 + 0.45 * len(found)))
    ax = fig.add_subplot()
    models = sorted({m for lane in found for m in lane.running})
    colours = {m: f"C{i % 10}" for i, m in enumerate(models)}
    span = max(b for lane in found for b in _ends(lane)) - min(lane.first for lane in found) or 1.0
    for y, lane in enumerate(found):
        bar = {"yrange": (y - 0.3, 0.6)}
        ax.broken_barh(_widths(lane.idle), **bar, facecolors=IDLE, gid=f"idle {lane.actor_id}")
        for model, ivs in lane.running.items():
            ax.broken_barh(_widths(ivs), **bar, facecolors=colours[model], gid=f"running {lane.actor_id}")
        for a, b, model in lane.starts:
            ax.broken_barh([(a, b - a)], **bar, facecolors=STARTING, gid=f"starting {lane.actor_id}")
            if (b - a) / span * AXES_PX > 7 * len(model) + 8:  # else the running bars' colour names it
                # at the bar's end: the engine's own start-up, after any wait for a model
                ax.text(b - 0.005 * span, y, model, ha="right", va="center", fontsize=7, color="white")
        ax.broken_barh(_widths(lane.waiting), **bar, facecolors=WAITING, hatch="///", edgecolor=STARTING,
                       gid=f"waiting {lane.actor_id}")
    ax.set_yticks(range(len(found)), [labels.get(lane.actor_id, lane.actor_id) for lane in found])
    ax.set_ylim(len(found) - 0.5, -0.5)  # first actor on top
    ax.set_xlabel(xlabel)
    ax.legend(handles=_legend(ax, found, colours, markers), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _legend(ax, found: list[Lane], colours: dict[str, str], markers: dict[str, tuple[float, str]]) -> list:
    """Legend entries for what was drawn, and the markers (drawn here)."""
    kinds = [(Patch(facecolor=STARTING, label="starting (engine start-up)"), any(lane.starts for lane in found)),
             (Patch(facecolor=WAITING, edgecolor=STARTING, hatch="///", label="starting: waiting for a model"),
              any(lane.waiting for lane in found)),
             (Patch(facecolor=IDLE, label="idle"), any(lane.idle for lane in found))]
    handles = [patch for patch, drawn in kinds if drawn]
    handles += [Patch(facecolor=colour, label=f"running {m}") for m, colour in colours.items()]
    return handles + [ax.axvline(x, color="black", linestyle=style, linewidth=1, label=name)
                      for name, (x, style) in markers.items()]


def utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)  # telemetry times are UTC, with or without tz


def _idle(lane: Lane) -> list[Interval]:
    busy = [i for ivs in lane.running.values() for i in ivs]
    if not busy:
        return []
    begin = min(b for _, b, _ in lane.starts) if lane.starts else min(a for a, _ in busy)
    end = max(b for _, b in busy)
    return gaps((begin, end), merge(busy + [(a, b) for a, b, _ in lane.starts]))


def _ends(lane: Lane) -> list[float]:
    return [b for _, b, _ in lane.starts] + [b for ivs in lane.running.values() for _, b in ivs]


def _widths(intervals: list[Interval]) -> list[Interval]:
    return [(a, b - a) for a, b in intervals]


def _length(intervals: list[Interval]) -> float:
    return float(sum(b - a for a, b in intervals))


def _timed_start(r: dict) -> bool:
    return bool(r["actor_id"]) and r["requested_at"] is not None and r["ready_at"] is not None


def _timed_shard(r: dict) -> bool:
    return bool(r["actor_id"]) and r["started_at"] is not None and r["finished_at"] is not None


def _since(t: datetime, t0: datetime) -> float:
    return (utc(t) - t0).total_seconds()
