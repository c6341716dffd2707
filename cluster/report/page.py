"""`raysweep report OUTPUT [OUTPUT ...]`: one self-contained HTML page on one or more sweep outputs.

In order: what ran (per output: sweep, spec hash, dates, versions); the models × tasks comparison
(comparison.py); the sample browser (samples.py); then, per output, the operator's view (operator.py:
timeline, throughput, GPU telemetry, start-up, failures, rows not ok). Plots are matplotlib PNGs inlined
as `data:` URIs and the browser's rows are JSON inside the page: the file opens anywhere with no network.
Only the columns a section needs are read, and texts only of the rows shown, so outputs of millions of
rows stay cheap. The pool's live page (cluster/pool/ingress.py) serves the same page, refreshed.
"""

from __future__ import annotations

import html
import sys
from collections import Counter
from pathlib import Path

from cluster.contracts.shard import ShardState
from cluster.report.comparison import Output, comparison
from cluster.report.html_parts import document, fmt
from cluster.report.operator import operator_view
from cluster.report.reading import ReportError, damaged, load_manifest, strays
from cluster.report.samples import LIMIT, browser

MAX_ROWS = 200  # problem rows listed per output; the total is always stated


def write_report(outputs: list[str] | str, out: str | None = None, max_rows: int = MAX_ROWS,
                 samples: int = LIMIT, warned: list[str] | None = None) -> Path:
    """Render the report of the sweep output(s) into `out` (default: the first output's report.html). What it
    left out (a file not committed, or not what was committed) is printed as a warning and added to `warned`."""
    outputs = [local_path(o) for o in ([outputs] if isinstance(outputs, str) else outputs)]
    uri = next((o for o in outputs if "://" in o), None)
    if uri is not None:  # Path() would read `s3://b/x` as the folder `s3:/b/x`
        raise ReportError(f"output {uri}: the report reads an output on this machine's disk; copy it here first "
                          "(e.g. `aws s3 sync URI DIR`) and give its folder")
    roots = [Path(o) for o in outputs]

    def warn(line: str) -> None:
        if warned is not None:
            warned.append(line)
        print(f"raysweep: warning: {line}", file=sys.stderr)

    page = render(roots, max_rows, samples, warn=warn)
    path = Path(out) if out else roots[0] / "report.html"
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"report {path}: cannot write: {e}") from None
    return path


def local_path(output: str) -> str:
    """A `file://` output as the folder it names (`run` writes there as it does to a plain path)."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(output)
    return unquote(parsed.path) if parsed.scheme == "file" and parsed.netloc in ("", "localhost") else output


def render(roots: list[Path], max_rows: int = MAX_ROWS, samples: int = LIMIT, refresh_s: int | None = None,
           warn=None, check_files: bool = True) -> str:
    """The page; `refresh_s` makes the browser reload it (the pool's live page, while a sweep runs). Files in an
    output's results/ that its manifest did not commit are left out, named in its header and to `warn`; with
    `check_files`, so are committed files that are not what their shard committed (each file read whole for its
    checksum: the report's command does it, not a live page reloaded every few seconds)."""
    manifests = {root: load_manifest(root) for root in roots}
    left_out = {root: strays(root, manifest) for root, manifest in manifests.items()}
    checked = {root: damaged(root, manifest) if check_files else (manifest, [])
               for root, manifest in manifests.items()}
    outputs = labelled([(root, checked[root][0]) for root in roots])
    bad = {root: lines for root, (_, lines) in checked.items()}
    for root, files in left_out.items():
        for line in bad[root]:
            if warn is not None:
                warn(f"output {root}: {line}: left out of the report")
        if files and warn is not None:
            warn(f"output {root}: {len(files)} file(s) in results/ that its manifest did not commit, left out of "
                 f"the report: {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}")
    several = len(outputs) > 1
    parts = ["\n".join(_header(o, several, left_out[o.root], bad[o.root]) for o in outputs), _nav(outputs),
             comparison(outputs), browser(outputs, samples)]
    for o in outputs:
        view = operator_view(o.root, o.manifest, max_rows)
        parts.append(f'<h2 class="operator">Operator view: {html.escape(o.label)}</h2>\n{view}' if several else view)
    sweeps = ", ".join(dict.fromkeys(str(o.manifest.get("sweep", o.root.name)) for o in outputs))
    return document("raysweep report: " + sweeps, "\n".join(parts), refresh_s)


def labelled(found: list[tuple[Path, dict]]) -> list[Output]:
    """Outputs with the labels their columns carry: none for one output; else their sweep names where those
    differ, their folder names where those do, else A, B, C ..."""
    if len(found) == 1:
        return [Output("", found[0][0], found[0][1])]
    for labels in ([str(m.get("sweep")) for _, m in found], [r.name for r, _ in found]):
        if len(set(labels)) == len(labels):
            return [Output(label, root, m) for label, (root, m) in zip(labels, found)]
    return [Output(chr(ord("A") + i) if i < 26 else f"#{i + 1}", root, m) for i, (root, m) in enumerate(found)]


def _header(out: Output, several: bool, left_out: list[str] = (), damaged_lines: list[str] = ()) -> str:
    manifest = out.manifest
    states = Counter(s.get("state") for s in manifest["shards"].values())
    versions = manifest.get("versions") or {}
    facts = {"output": str(out.root), "spec hash": manifest.get("spec_hash"), "created": manifest.get("created_at"),
             "finished": manifest.get("finished_at") or "not finished",
             "shards": f"{states[ShardState.COMMITTED]} committed, {states[ShardState.FAILED]} failed, "
                       f"{states[ShardState.PENDING]} pending",
             "versions": ", ".join(f"{k} {fmt(v)}" for k, v in sorted(versions.items()))}
    if damaged_lines:  # first: what the page's counts (from summary.parquet) still include
        facts["not what was committed"] = (f"{len(damaged_lines)} results file(s), left out of this page (its counts "
                                           f"table is the run's own and still counts them): "
                                           f"{'; '.join(damaged_lines[:3])}{' ...' if len(damaged_lines) > 3 else ''}")
    if left_out:
        facts["left out"] = (f"{len(left_out)} file(s) in results/ that the manifest did not commit: "
                             f"{', '.join(left_out[:3])}{' ...' if len(left_out) > 3 else ''}")
    if several:
        facts = {"label": out.label, **facts}
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(fmt(v))}</dd>" for k, v in facts.items())
    return f"<h1>{html.escape('raysweep report: ' + str(manifest.get('sweep')))}</h1>\n<dl>{items}</dl>"


def _nav(outputs: list[Output]) -> str:
    links = [("comparison", "models × tasks"), ("samples", "samples")]
    if len(outputs) == 1:
        links += [("timeline", "timeline"), ("throughput", "throughput"), ("gpu", "GPU"), ("startup", "start-up"),
                  ("failures", "failures"), ("rows", "rows not ok")]
    return "<nav>" + "".join(f'<a href="#{i}">{html.escape(t)}</a>' for i, t in links) + "</nav>"
