"""The pool application's ingress (cluster/pool/serve_app.py): what the pool serves, for sweeps and `raysweep
pool status`, a read-only HTTP API over the sweeps that used the pool, from what each sweep records as it
runs (cluster/pool/client.SweepRecorder), and a live page:

    GET /raysweep/                        the live page: every sweep run, its progress, a link to its report
    GET /raysweep/sweeps                  every sweep run: run id, name, state, samples done of total
    GET /raysweep/sweeps/RUN              one run (its run id, or a name: that name's latest run)
    GET /raysweep/sweeps/RUN/summary      its summary table (model, task, n, score, ...) as JSON rows
    GET /raysweep/sweeps/RUN/report       its report (cluster/report/page.py), rendered now from its output

Runs are keyed by run id, so two sweeps of one name keep two records. A run that has not reported for
GONE_AFTER_S while running (its driver was killed: it reports every 2 s) is shown as `gone`. The pages of a
running sweep reload themselves every REFRESH_S. A report is rendered from the sweep's output folder, read
where the ingress runs: an output on another node's disk is named, not shown.
"""

from __future__ import annotations

import html
import time
from pathlib import Path

from cluster.contracts.pool_protocol import ROUTE, SweepState
from cluster.report.html_parts import document

REFRESH_S = 5
LIST_KEYS = ("run_id", "name", "state", "samples_done", "samples_total", "shards_failed", "output", "updated_at")


class PoolIngress:
    GONE_AFTER_S = 30.0

    def __init__(self, description: dict, *replicas):
        self.description = description
        self.replicas = replicas  # handles of the model deployments (keeps them in the application)
        self.sweeps: dict[str, dict] = {}

    def describe(self) -> dict:
        return self.description

    def record(self, run_id: str, snapshot: dict) -> None:
        """A sweep run's state, sent by its driver as it runs and when it ends (cluster/pool/client.SweepRecorder)."""
        self.sweeps[run_id] = dict(snapshot, run_id=run_id, name=snapshot.get("name", run_id), updated_at=time.time())

    def shown(self, sweep: dict) -> dict:
        """A run as the API shows it: `running` past its heartbeat is `gone`."""
        if sweep.get("state") == SweepState.RUNNING and time.time() - sweep["updated_at"] > self.GONE_AFTER_S:
            return dict(sweep, state=SweepState.GONE.value)
        return sweep

    def find(self, key: str) -> dict | None:
        """A run by its id, else the latest run of that name."""
        if key in self.sweeps:
            return self.sweeps[key]
        named = [s for s in self.sweeps.values() if s["name"] == key]
        return max(named, key=lambda s: s["updated_at"]) if named else None

    async def __call__(self, request):
        from starlette.responses import HTMLResponse, JSONResponse

        parts = [p for p in request.url.path.split("/") if p]
        if parts[:1] == [ROUTE.strip("/")]:  # the application's route prefix
            parts = parts[1:]
        if parts == []:
            return HTMLResponse(self.live_page())
        if parts == ["sweeps"]:
            return JSONResponse([{k: s.get(k) for k in LIST_KEYS} for s in map(self.shown, self.sweeps.values())])
        if len(parts) in (2, 3) and parts[0] == "sweeps":
            sweep = self.find(parts[1])
            if sweep is None:
                return JSONResponse({"error": f"no sweep {parts[1]!r} has used this pool"}, status_code=404)
            if len(parts) == 2:
                return JSONResponse({k: v for k, v in self.shown(sweep).items() if k != "summary"})
            if parts[2] == "summary":
                return JSONResponse(sweep.get("summary") or [])
            if parts[2] == "report":
                import asyncio

                status, page = await asyncio.to_thread(self.report_page, self.shown(sweep))
                return HTMLResponse(page, status_code=status)
        return JSONResponse({"error": "not found; try /raysweep/ or /raysweep/sweeps"}, status_code=404)

    def live_page(self) -> str:
        """Every run, newest first, with its progress and a link to its report; reloads while one runs."""
        runs = sorted(map(self.shown, self.sweeps.values()), key=lambda s: -s["updated_at"])
        rows = "".join(
            f"<tr><td><a href=\"{ROUTE}/sweeps/{html.escape(s['run_id'])}/report\">{html.escape(s['name'])}</a></td>"
            f"<td>{html.escape(s['run_id'])}</td><td>{html.escape(str(s.get('state')))}</td>"
            f"<td>{s.get('samples_done') or 0} of {s.get('samples_total') or '?'}</td>"
            f"<td>{s.get('shards_failed') or 0}</td><td>{html.escape(str(s.get('output')))}</td>"
            f"<td>{time.strftime('%H:%M:%S', time.gmtime(s['updated_at']))} UTC</td></tr>\n" for s in runs)
        running = any(s.get("state") == SweepState.RUNNING for s in runs)
        served = ", ".join(m.get("name", "?") for m in self.description.get("models", ())) or "—"
        body = (f"<h1>raysweep pool</h1><p>serves: {html.escape(served)}</p>"
                + ("<table id=\"pool-sweeps\"><thead><tr><th>sweep</th><th>run</th><th>state</th><th>samples</th>"
                   "<th>failed shards</th><th>output</th><th>last heard</th></tr></thead><tbody>\n"
                   f"{rows}</tbody></table>" if runs else "<p>No sweep has used this pool yet.</p>"))
        return document("raysweep pool", body, REFRESH_S if running else None)

    def report_page(self, sweep: dict) -> tuple[int, str]:
        """(status, HTML): the run's report, rendered now from its output; reloads while the run runs."""
        from cluster.report.page import render
        from cluster.report.reading import ReportError

        output, refresh = sweep.get("output"), REFRESH_S if sweep.get("state") == SweepState.RUNNING else None
        if not output or "://" in str(output) or not Path(output).is_dir():
            where = ("copy it to a folder and run <code>raysweep report FOLDER</code>" if "://" in str(output) else
                     f"run <code>raysweep report {html.escape(str(output))}</code> where the sweep ran")
            return 404, document(f"raysweep: {sweep['name']}", (
                f"<h1>{html.escape(sweep['name'])}</h1><p class=\"note\">Its output {html.escape(str(output))} is "
                f"not a folder here (the pool's ingress reads outputs on its own node): {where}.</p>"), refresh)
        try:
            # no checksums on a page reloaded every few seconds: `raysweep report` and `verify` check the files
            return 200, render([Path(output)], refresh_s=refresh, check_files=False)
        except ReportError as e:  # e.g. the first shard is not committed yet: no manifest
            return 200, document(f"raysweep: {sweep['name']}", f"<h1>{html.escape(sweep['name'])}</h1>"
                              f"<p class=\"note\">{html.escape(str(e))}</p>", refresh)

