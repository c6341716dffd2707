"""`raysweep report`: the HTML page of a sweep output built here with pyarrow (no Ray), checked as text and
as Chromium renders it (headless, screenshot and DOM). At the end, the other commands that only print:
`raysweep models` and `raysweep spec-reference`."""

import json
import math
import os
import re
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from html import unescape
from pathlib import Path

import matplotlib.image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.score.summary import summarize
from cluster.store.output_files import result_file
from cluster.report import timeline as report_timeline
from jobs.cli import main
from cluster.report.operator import _phase_widths
from cluster.report.comparison import best
from cluster.report.page import write_report

T0 = datetime(2026, 11, 20, 9, 0, tzinfo=timezone.utc)
ACTOR_A, ACTOR_B, ACTOR_C = "a1" * 16, "b2" * 16, "c3" * 16
FAILED_SHARD = "tiny-a/arith/00002"
GPU_ALT = "GPU memory and utilisation per actor (NVML)"


def _row(model, task, shard, i, status="ok", score=1.0, error=None, text="42"):
    return {"sweep": "nightly", "model": model, "task": task, "sample_id": f"{task}-{shard}-{i}",
            "shard_id": f"{model}/{task}/{shard:05d}", "prompt_tokens": 30 + i, "output_text": text,
            "output_tokens": 0 if status in ("skipped", "error") else 8,
            "finish_reason": {"ok": "stop", "truncated": "length"}.get(status),
            "status": status, "structured": None, "structured_valid": True if task == "choice" else None,
            "target": "42", "score": score, "latency_s": 0.5, "ttft_s": 0.05, "error": error}


# shard file -> rows: 3 ok + 1 error + 1 truncated in tiny-a/arith; tiny-b/choice scores 1, 1, 0 + 1 skipped
RESULTS = {
    ("tiny-a", "arith", 0): [_row("tiny-a", "arith", 0, 0), _row("tiny-a", "arith", 0, 1, score=0.0),
                             _row("tiny-a", "arith", 0, 2, "error", None, "CUDA error: <boom> & co", None),
                             _row("tiny-a", "arith", 0, 3, "truncated", 0.0, text="x" * 500)],
    ("tiny-a", "arith", 1): [_row("tiny-a", "arith", 1, i) for i in range(3)],
    ("tiny-b", "choice", 0): [_row("tiny-b", "choice", 0, 0), _row("tiny-b", "choice", 0, 1),
                              _row("tiny-b", "choice", 0, 2, score=0.0),
                              _row("tiny-b", "choice", 0, 3, "skipped", None, "prompt over max_model_len", None)],
}


def _shard_attempt(shard_id, attempt, actor, minutes, tok_per_s):
    return {"shard_id": shard_id, "attempt": attempt, "actor_id": actor, "node_ip": "10.0.0.7",
            "gpu_name": "NVIDIA L4", "engine": "vllm", "cuda_graphs": actor == ACTOR_A, "profile": "short",
            "chunked_prefill": False, "max_num_batched_tokens": None, "n_samples": 4, "prompt_tokens": 130,
            "output_tokens": 32, "wall_s": 32 / tok_per_s, "output_tok_per_s": tok_per_s,
            "gpu_mem_used_max_mib": 20500.0, "gpu_util_mean_pct": 80.0, "power_mean_w": 60.0,
            "started_at": T0 + timedelta(minutes=minutes - 1), "finished_at": T0 + timedelta(minutes=minutes),
            "error": None}


def _write_output(root: Path, gpu: str) -> Path:
    """A sweep output as cluster.store.sink writes it; `gpu` is "readings", "nulls" (NVML columns all null)
    or "absent" (no gpu.parquet, as on CPU machines)."""
    shards = {}
    for (model, task, index), rows in RESULTS.items():
        rel = result_file(model, task, index)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), root / rel)
        shards[f"{model}/{task}/{index:05d}"] = {"state": "committed", "file": rel, "rows": len(rows), "attempts": 1}
    shards[FAILED_SHARD] = {"state": "failed", "attempts": 2,
                            "errors": ["ActorDiedError: actor a1a1 died", "ActorDiedError: actor b2b2 died"]}
    shards["tiny-b/choice/00001"] = {"state": "pending"}
    (root / "manifest.json").write_text(json.dumps({
        "sweep": "nightly", "spec_hash": "5a8e3bdbf6d1c990", "created_at": T0.isoformat(),
        "finished_at": (T0 + timedelta(minutes=9)).isoformat(),
        "versions": {"python": "3.11.7", "ray": "2.60.0", "vllm": "0.26.0", "torch": "2.9.0"}, "shards": shards}))
    all_rows = [r for rows in RESULTS.values() for r in rows]
    pq.write_table(summarize(pa.Table.from_pylist(all_rows)), root / "summary.parquet")

    (root / "telemetry").mkdir()
    attempts = [_shard_attempt("tiny-a/arith/00000", 1, ACTOR_A, 2, 410.0),
                _shard_attempt("tiny-a/arith/00001", 1, ACTOR_A, 4, 530.0),
                {"shard_id": FAILED_SHARD, "attempt": 1, "error": "ActorDiedError: actor a1a1 died"},
                {"shard_id": FAILED_SHARD, "attempt": 2, "error": "ActorDiedError: actor b2b2 died"},
                _shard_attempt("tiny-b/choice/00000", 1, ACTOR_B, 3, 250.0)]
    pq.write_table(pa.Table.from_pylist(attempts), root / "telemetry/shards.parquet")
    actors = [{"actor_id": ACTOR_A, "node_ip": "10.0.0.7", "gpu_name": "NVIDIA L4", "model": "tiny-a",
               "engine": "vllm", "profile": "short", "load_s": 12.5, "compile_s": 30.1, "graph_capture_s": 8.2,
               "cuda_graphs": True, "graph_mode": "FULL_AND_PIECEWISE", "fallback_reason": None},
              {"actor_id": ACTOR_B, "node_ip": "10.0.0.8", "gpu_name": "NVIDIA L4", "model": "tiny-b",
               "engine": "vllm", "profile": "short", "load_s": 11.0, "compile_s": 28.0, "graph_capture_s": None,
               "cuda_graphs": False, "graph_mode": None,
               "fallback_reason": "graph capture failed: CUDA out of memory; restarted eager"}]
    pq.write_table(pa.Table.from_pylist(actors), root / "telemetry/actors.parquet")
    if gpu != "absent":
        pq.write_table(_gpu_readings(gpu == "nulls"), root / "telemetry/gpu.parquet")
    return root


def _gpu_readings(nulls: bool) -> pa.Table:
    """GpuSampler's columns (actors/telemetry.py) plus the actor's ids, five readings per actor."""
    rows = []
    for k, actor in enumerate((ACTOR_A, ACTOR_B)):
        for i in range(5):
            reading = {"time": T0.timestamp() + 60 * (1 + i), "mem_used_mib": 18000.0 + 500 * i + 2000 * k,
                       "util_pct": 40.0 + 10 * i - 5 * k, "power_w": 55.0 + i, "sm_clock_mhz": 1800.0,
                       "temp_c": 60.0 + i}
            if nulls:
                reading = {c: None for c in reading} | {"time": reading["time"]}
            rows.append(reading | {"actor_id": actor, "node_id": f"node{k}", "gpu_name": "NVIDIA L4"})
    return pa.Table.from_pylist(rows, schema=pa.schema(
        [(c, pa.float64()) for c in ("time", "mem_used_mib", "util_pct", "power_w", "sm_clock_mhz", "temp_c")]
        + [(c, pa.string()) for c in ("actor_id", "node_id", "gpu_name")]))


def _comparison(page: str) -> dict[tuple[str, str], dict[str, tuple | None]]:
    """The models × tasks table: (task, metric) -> column -> (value, stderr, text, classes), None where empty."""
    table = re.search(r'<table id="comparison">(.*?)</table>', page, re.DOTALL).group(1)
    head = [unescape(h) for h in re.findall(r"<th>(.*?)</th>", table.split("<tbody>")[0])][2:]
    found = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", table.split("<tbody>")[1], re.DOTALL):
        cells = re.findall(r'<td(?: class="([^"]*)")?(?: data-value="([^"]*)")?(?: data-stderr="([^"]*)")?>(.*?)</td>',
                           tr, re.DOTALL)
        task, metric = unescape(cells[0][3]), unescape(cells[1][3])
        found[(task, metric)] = {
            h: None if not value else (float(value), float(stderr) if stderr else None, unescape(text), cls.split())
            for h, (cls, value, stderr, text) in zip(head, cells[2:])}
    return found


def _table_rows(page: str, table_id: str) -> list[list[str]]:
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', page, re.DOTALL)
    assert table, f"no table id={table_id}"
    body = table.group(1).split("<tbody>")[1]
    return [[unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr, re.DOTALL)]
            for tr in re.findall(r"<tr>(.*?)</tr>", body, re.DOTALL)]


@pytest.fixture
def sweep_output(tmp_path) -> Path:
    return _write_output(tmp_path / "out", gpu="readings")


def test_report_holds_scores_plots_failures_and_rows(sweep_output):
    page = write_report(str(sweep_output)).read_text()
    assert "<h1>raysweep report: nightly</h1>" in page and "5a8e3bdbf6d1c990" in page and "vllm 0.26.0" in page
    assert "2026-11-20T09:09:00+00:00" in page and "3 committed, 1 failed, 1 pending" in page

    counts = {(r[0], r[1]): r for r in _table_rows(page, "scores")}
    assert counts[("tiny-b", "choice")] == ["tiny-b", "choice", "4", "4", "3", "3", "0", "1", "0", "100.0%", "24"]
    assert counts[("tiny-a", "arith")][2:9] == ["7", "7", "6", "5", "1", "0", "1"]
    compared = _comparison(page)
    # tiny-b/choice scores 1, 1, 0: mean 2/3, stderr sqrt(var / n) = sqrt((1/3) / 3) = 1/3
    assert compared[("choice", "score")]["tiny-b"][2] == "0.667 ± 0.333"
    assert compared[("choice", "score")]["tiny-a"] is None and compared[("arith", "score")]["tiny-b"] is None
    assert compared[("arith", "score")]["tiny-a"][2] == "0.667 ± 0.211"  # one model: no best to mark

    failed = _table_rows(page, "failed-shards")
    assert failed == [[FAILED_SHARD, "2", "1: ActorDiedError: actor a1a1 died\n2: ActorDiedError: actor b2b2 died"]]
    assert "graph capture failed: CUDA out of memory; restarted eager" in page

    assert "3 rows did not come out ok (error: 1, skipped: 1, truncated: 1); all are listed." in page
    rows = {r[3]: r for r in _table_rows(page, "problem-rows")}
    assert rows["arith-0-2"][4] == "error" and rows["arith-0-2"][8] == "CUDA error: <boom> & co"
    assert rows["arith-0-3"][9] == "x" * 200 + "…"  # output text of a listed row, cut
    assert "CUDA error: &lt;boom&gt; &amp; co" in page and "<boom>" not in page

    assert page.count('src="data:image/png;base64,') == 5  # comparison, timeline, throughput, GPU, start-up
    assert f'alt="{GPU_ALT}"' in page and "No NVML readings" not in page
    assert not re.search(r'(?:src|href)="(?!data:|#)', page), "the page must not load anything from outside"


@pytest.mark.parametrize("gpu", ["absent", "nulls"])
def test_report_without_nvml_says_so_and_plots_no_zeros(tmp_path, gpu):
    page = write_report(str(_write_output(tmp_path / "out", gpu))).read_text()
    assert "No NVML readings: telemetry/gpu.parquet " + ("is absent" if gpu == "absent" else "holds no") in page
    assert GPU_ALT not in page
    assert page.count('src="data:image/png;base64,') == 4  # comparison, timeline, throughput and start-up only


def test_problem_rows_are_capped_and_counted(sweep_output):
    page = write_report(str(sweep_output), max_rows=2).read_text()
    assert "3 rows did not come out ok (error: 1, skipped: 1, truncated: 1); the first 2 are listed." in page
    assert len(_table_rows(page, "problem-rows")) == 2


def test_report_of_a_file_uri_or_a_folder_named_with_a_colon_is_written(sweep_output, tmp_path, monkeypatch):
    """`file:///abs/out`, which `run` writes to, was refused as a remote output; a folder named `run:1` was read by
    pyarrow as a URI ("summary.parquet cannot be read")."""
    colon = tmp_path / "run:1"
    shutil.copytree(sweep_output, colon)
    monkeypatch.chdir(tmp_path)  # the folder as a user names it, relative
    assert write_report("run:1") == Path("run:1/report.html") and "tiny-a" in (colon / "report.html").read_text()
    assert write_report(f"file://{sweep_output}") == sweep_output / "report.html"


def test_cli_writes_report_to_default_and_given_path(sweep_output, tmp_path, capsys):
    assert main(["report", str(sweep_output)]) == 0
    assert capsys.readouterr().out.strip() == str(sweep_output / "report.html")
    assert (sweep_output / "report.html").read_text().startswith("<!DOCTYPE html>")
    other = tmp_path / "elsewhere.html"
    assert main(["report", str(sweep_output), "-o", str(other)]) == 0
    assert capsys.readouterr().out.strip() == str(other) and other.is_file()


@pytest.mark.parametrize("case, message", [
    ("missing", "no such directory"), ("empty", "no manifest.json"), ("bad-json", "manifest.json: unreadable"),
    ("no-shards", "no `shards` mapping"), ("bad-runs", "manifest.json: `runs` is not a list of runs"),
    # these were tracebacks (KeyError, AttributeError); a URI was read as the folder `s3:/b/x`
    ("committed-without-file", "shard t/q/00000: committed without the path of its results file"),
    ("bad-versions", "manifest.json: `versions` is not a mapping"),
    ("uri", "the report reads an output on this machine's disk; copy it here first"),
    ("a-file", "a file, not a folder (expected a sweep's output"),  # it said "no such directory"
    ("rows-text", 'shard t/q/00000: rows "5" is not a count of rows'),  # said "has 5 rows, 5 were committed"
])
def test_cli_refuses_what_is_not_a_sweep_output(tmp_path, capsys, case, message):
    root = "s3://b/x" if case == "uri" else tmp_path / case
    if case == "a-file":
        root.write_text("x")
    elif case not in ("missing", "uri"):
        root.mkdir()
    if case == "rows-text":
        (root / "manifest.json").write_text('{"sweep": "x", "shards": {"t/q/00000": {"state": "committed", "rows": "5", '
                                            '"file": "results/t/q/shard-00000.parquet"}}}')
    if case == "committed-without-file":
        (root / "manifest.json").write_text('{"sweep": "x", "shards": {"t/q/00000": {"state": "committed", "rows": 5}}}')
    if case == "bad-versions":
        (root / "manifest.json").write_text('{"sweep": "x", "shards": {}, "versions": [1]}')
    if case == "bad-json":
        (root / "manifest.json").write_text("{not json")
    if case == "no-shards":
        (root / "manifest.json").write_text('{"sweep": "x"}')
    if case == "bad-runs":
        (root / "manifest.json").write_text('{"sweep": "x", "shards": {}, "runs": [{"started_at": "yesterday"}]}')
    assert main(["report", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"raysweep: error: output {root}") and message in err


# -- comparison and sample browser --------------------------------------------------------------------
def _qa_output(root: Path, sweep: str, scores: dict[str, list[float]]) -> Path:
    """An output of task `qa` on several models, a shard per model; `scores[model][i]` is sample i's score
    (None: an error row). Every sample's prompt is rendered alike for every model."""
    shards, all_rows = {}, []
    for model, values in scores.items():
        rows = [_row(model, "qa", 0, i, "ok" if v is not None else "error", v,
                     None if v is not None else "engine said no", f"{model} says {i}") | {
                "sample_id": f"q{i}", "prompt": f"Question {i} <b>?</b>", "completion": 0} for i, v in enumerate(values)]
        rel = result_file(model, "qa", 0)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), root / rel)
        shards[f"{model}/qa/00000"] = {"state": "committed", "file": rel, "rows": len(rows), "attempts": 1}
        all_rows += rows
    (root / "manifest.json").write_text(json.dumps({"sweep": sweep, "spec_hash": "0" * 16, "shards": shards}))
    pq.write_table(summarize(pa.Table.from_pylist(all_rows)), root / "summary.parquet")
    return root


def _browser_data(page: str) -> dict:
    payload = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.DOTALL)
    return json.loads(payload.group(1))


def test_comparison_marks_the_best_model_and_the_browser_puts_disagreements_first(tmp_path):
    root = _qa_output(tmp_path / "out", "two-models", {"tiny": [1, 0, 1, 0, 0, None], "small": [1, 1, 1, 0, 1, 1]})
    page = write_report(str(root)).read_text()
    summary = pq.read_table(root / "summary.parquet").to_pylist()
    compared = _comparison(page)[("qa", "score")]
    for r in summary:  # the comparison's numbers are summary.parquet's, exactly
        assert compared[r["model"]][:2] == (r["score"], r["stderr"])
    assert "best" in compared["small"][3] and compared["small"][2].endswith(" ★") and "best" not in compared["tiny"][3]
    assert best("score", {"a": (0.0, 0.0), "b": (0.0, 0.0)}) == set()  # a tie of every column marks nothing
    assert best("word_perplexity", {"a": (9.5, 0.1), "b": (7.25, 0.1), "c": (7.25, 0.2)}) == {"b", "c"}

    data = _browser_data(page)
    assert data["columns"] == ["small", "tiny"]
    qa = data["tasks"]["qa"]
    assert qa["rows"] == 6 and len(qa["shown"]) == 6  # every sample of the task is listed
    order = [r["id"] for r in qa["shown"]]
    assert order[:3] == ["q1", "q4", "q5"] and {r["id"] for r in qa["shown"] if r["disagree"]} == {"q1", "q4", "q5"}
    q5 = qa["shown"][2]
    assert [c["status"] for c in q5["cells"]] == ["ok", "error"] and q5["cells"][1]["why"] == "engine said no"
    assert q5["prompt"] == "Question 5 <b>?</b>" and q5["cells"][0]["output"] == "small says 5"
    assert "<b>?</b>" not in page  # texts travel escaped: no row can add markup to the page
    capped = _browser_data(write_report(str(root), str(tmp_path / "capped.html"), samples=2).read_text())
    assert [r["id"] for r in capped["tasks"]["qa"]["shown"]] == ["q1", "q4"] and capped["tasks"]["qa"]["rows"] == 6


def test_the_browser_shows_unprintable_characters_as_escapes(tmp_path):
    """A completion's NUL, terminal escape sequence or bidirectional override showed as a box, or reordered the
    text around it; they are written as escapes. Tabs, line ends and printable text of any script stay."""
    from cluster.report.html_parts import visible

    root = _qa_output(tmp_path / "out", "unprintable", {"tiny": [1, 0]})
    rel = result_file("tiny", "qa", 0)
    rows = pq.read_table(root / rel).to_pylist()
    rows[1] |= {"output_text": "a\x00b\x1b[31mred\x7f\tcafé 🙂\n\u202eevil\x85\ue000",
                "prompt": "Q\x01" + "x" * 2000, "error": "died\x07"}
    pq.write_table(pa.Table.from_pylist(rows), root / rel)
    page = write_report(str(root)).read_text()
    q1 = next(r for r in _browser_data(page)["tasks"]["qa"]["shown"] if r["id"] == "q1")
    assert q1["cells"][0]["output"] == "a\\x00b\\x1b[31mred\\x7f\tcafé 🙂\n\\u202eevil\\x85\\ue000"
    assert q1["prompt"] == "Q\\x01" + "x" * 1498 + "… (502 more characters)"  # cut by the text's own characters
    assert "\x00" not in page and "\x1b" not in page and "\u202e" not in page
    assert visible(None) is None and visible("plain ascii, ünïcödé, 中文, 🙂\t\r\n") == "plain ascii, ünïcödé, 中文, 🙂\t\r\n"
    assert q1["cells"][0]["why"] == "died\\x07"
    assert visible("\U000e0001\U0010fffd") == "\U000e0001\\U0010fffd"  # a format tag stays, private use is escaped


def test_a_nan_or_infinite_score_keeps_the_browsers_data_valid_json(tmp_path, capsys):
    """A NaN or inf score was embedded as bare NaN/Infinity: not JSON, and the sample browser did not load."""
    nan, inf = float("nan"), float("inf")
    root = _qa_output(tmp_path / "out", "odd-scores", {"tiny": [nan, inf, -inf, 0.5]})
    page = write_report(str(root)).read_text()
    payload = re.search(r'id="samples-data">(.*?)</script>', page, re.DOTALL).group(1)
    data = json.loads(payload, parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))
    assert {r["id"]: r["cells"][0]["score"] for r in data["tasks"]["qa"]["shown"]} == \
        {"q0": "NaN", "q1": "inf", "q2": "-inf", "q3": 0.5}
    with pytest.raises(SystemExit) as refused:
        main(["report", str(root), "--samples", "-5"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "raysweep report: error: argument --samples: -5: must be at least 0"
    with pytest.raises(SystemExit) as refused:  # was an OverflowError traceback from inside the report
        main(["report", str(root), "--samples", "99999999999999999999"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "raysweep report: error: argument --samples: 99999999999999999999: must be at most 1000000"
    assert main(["report", str(root), "--samples", "0"]) == 0


def test_two_outputs_side_by_side_mark_differences_beyond_their_stderr(tmp_path, capsys):
    before = _qa_output(tmp_path / "monday", "nightly", {"tiny": [1, 0, 1, 0, 0, 0] * 4, "small": [1, 1, 1, 0, 1, 1] * 4})
    after = _qa_output(tmp_path / "tuesday", "nightly", {"tiny": [1, 1, 1, 1, 1, 1] * 4, "small": [1, 1, 1, 0, 1, 1] * 3 + [1, 1, 1, 0, 0, 1]})
    out = tmp_path / "both.html"
    assert main(["report", str(before), str(after), "-o", str(out)]) == 0
    page = out.read_text()
    compared = _comparison(page)[("qa", "score")]
    assert list(compared) == ["monday · small", "monday · tiny", "tuesday · small", "tuesday · tiny"]
    # tiny: 1/3 -> 1, far beyond the stderr of the difference; small: 20/24 -> 19/24, within it
    assert "differs" in compared["tuesday · tiny"][3] and "(Δ +0.667)" in compared["tuesday · tiny"][2]
    assert "differs" not in compared["tuesday · small"][3] and "Δ" not in compared["tuesday · small"][2]
    data = _browser_data(page)
    assert data["columns"] == list(compared)
    assert data["tasks"]["qa"]["disagree"] == 4 * 4  # q1, q3, q4, q5 of each repeat: a column disagrees
    assert page.count('<h2 class="operator">Operator view: ') == 2


# -- timeline ----------------------------------------------------------------------------------------
def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _start(actor, model, reason, requested, ready, **phases):
    """A telemetry/actors row with the start-up columns; times in seconds since T0, phases as given."""
    row = {"actor_id": actor, "node_ip": "10.0.0.7", "gpu_name": "NVIDIA H100", "model": model, "engine": "vllm",
           "profile": "short", "load_s": None, "compile_s": None, "graph_capture_s": None, "cuda_graphs": True,
           "graph_mode": "FULL", "fallback_reason": None, "restart": int(reason != "first"), "reason": reason,
           "requested_at": _at(requested), "process_started_at": None, "ready_at": _at(ready),
           "startup_s": float(ready - requested)}
    return row | {c: phases.get(c) for c in ("process_s", "imports_s", "waiting_s", "engine_init_s", "warmup_s",
                                             "first_token_s")}


def _shard(actor, model, index, started, finished):
    return {"shard_id": f"{model}/arith/{index:05d}", "attempt": 1, "actor_id": actor, "model": model,
            "task": "arith", "started_at": _at(started), "finished_at": _at(finished), "error": None}


# Actor A (tiny-a): starts 10-40 (of which waiting for a model 25-31); shards 40-100 and 60-120 overlap
# (running 40-120); idle 120-150; profile restart 150-170; shard 170-230; idle 230-240; shard 240-250:
# starting 50, running 150, idle 40 (of 240).
# Actor B: starts 10-70 (tiny-b; waiting 40-45); idle 70-80; shard 80-140; model change 140-160 (tiny-c);
# shard 160-220: starting 80, running 120, idle 10 (of 210). Actor C ran in the first run, an hour earlier.
TIMELINE_STARTS = [
    _start(ACTOR_C, "tiny-a", "first", -3595, -3565),
    _start(ACTOR_A, "tiny-a", "first", 10, 40, process_s=5.0, imports_s=10.0, waiting_s=6.0, engine_init_s=6.0,
           warmup_s=2.0, first_token_s=0.5),
    _start(ACTOR_A, "tiny-a", "profile", 150, 170, engine_init_s=15.0, warmup_s=5.0),
    _start(ACTOR_B, "tiny-b", "first", 10, 70, process_s=20.0, imports_s=10.0, waiting_s=5.0, engine_init_s=21.0,
           warmup_s=4.0, first_token_s=0.25),
    _start(ACTOR_B, "tiny-c", "model", 140, 160, engine_init_s=18.0, warmup_s=2.0, first_token_s=0.25),
]
TIMELINE_SHARDS = [
    _shard(ACTOR_C, "tiny-a", 9, -3560, -3500),
    _shard(ACTOR_A, "tiny-a", 0, 40, 100), _shard(ACTOR_A, "tiny-a", 1, 60, 120),
    _shard(ACTOR_A, "tiny-a", 2, 170, 230), _shard(ACTOR_A, "tiny-a", 3, 240, 250),
    _shard(ACTOR_B, "tiny-b", 0, 80, 140), _shard(ACTOR_B, "tiny-c", 0, 160, 220),
    {"shard_id": "tiny-b/arith/00001", "attempt": 1, "error": "ActorDiedError: actor b2b2 died"},
]
RUNS = [{"started_at": (T0 - timedelta(hours=1)).isoformat(), "ray_start_s": 3.0, "planning_s": 4.0,
         "first_result_s": 50.0, "last_result_s": 100.0, "wall_s": 101.0},
        {"started_at": T0.isoformat(), "ray_start_s": 4.5, "planning_s": 8, "first_result_s": 100.0,
         "last_result_s": 250.0, "wall_s": None, "tail_idle_share": 0.0667, "tail_splits": 2}]


@pytest.fixture
def timeline_output(tmp_path) -> Path:
    """An output holding only what the timeline reads: telemetry with the start-up columns, two runs."""
    root = tmp_path / "out"
    (root / "telemetry").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"sweep": "timeline", "shards": {}, "runs": RUNS}))
    pq.write_table(pa.Table.from_pylist(TIMELINE_STARTS), root / "telemetry/actors.parquet")
    pq.write_table(pa.Table.from_pylist(TIMELINE_SHARDS), root / "telemetry/shards.parquet")
    return root


def _section_html(page: str, section_id: str) -> str:
    found = re.search(rf'<section id="{section_id}">(.*?)</section>', page, re.DOTALL)
    assert found, f"no section id={section_id}"
    return found.group(1)


def test_timeline_counts_starting_running_and_idle_per_actor(timeline_output):
    page = write_report(str(timeline_output)).read_text()
    assert page.index("<h2>Models × tasks</h2>") < page.index('<section id="samples">') \
        < page.index('<section id="timeline">') < page.index('id="throughput"')
    section = _section_html(page, "timeline")
    assert section.count('<img alt="when each actor was starting, running shards and idle"') == 1
    assert _table_rows(page, "timeline-actors") == [  # actor C, of the first run, is left out
        ["tiny-a · a1a1a1a1", "2", "50.000", "6.000", "150.000", "40.000", "16.7%", "0.000"],
        # labelled by every model it ran, in order (not by its last one alone); its last shard ended at 220,
        # the run's at 250: 30 s idle at the tail
        ["tiny-b → tiny-c · b2b2b2b2", "2", "80.000", "5.000", "120.000", "10.000", "4.8%", "30.000"]]
    assert "Run 2 of 2 is drawn" in section and "no requested_at" not in section
    # the run's own tail figure, as its `tail:` line printed it; a run recorded before it has none
    assert _table_rows(page, "runs") == [["1", "2026-11-20 08:00:00", "3.000", "4.000", "50.000", "100.000", "101.000",
                                          "—", "—"],
                                         ["2", "2026-11-20 09:00:00", "4.500", "8.000", "100.000", "250.000", "—",
                                          "6.7%", "2"]]


def test_a_running_sweeps_report_reads_the_telemetry_parts_not_folded_in_yet(timeline_output, tmp_path):
    """Telemetry reaches the output as parts under telemetry/.pending as the actors start and shards commit, and is
    folded into the tables as the run ends: the report of a sweep still running reads the tables and the parts,
    with first tokens folded in as the run's end would, and writes nothing."""
    import pyarrow.fs as pafs

    from cluster.contracts.telemetry_schema import FIRST_TOKENS
    from cluster.store.telemetry_store import TelemetryStore

    folded = write_report(str(timeline_output)).read_text()
    running = tmp_path / "running"
    (running / "telemetry").mkdir(parents=True)
    shutil.copy(timeline_output / "manifest.json", running / "manifest.json")
    starts = [{**row, "start_index": i} for i, row in enumerate(TIMELINE_STARTS)]
    pq.write_table(pa.Table.from_pylist(starts[:1]), running / "telemetry/actors.parquet")  # the first run's
    store = TelemetryStore(pafs.LocalFileSystem(), str(running))
    for row in starts[1:3]:
        store.add("actors", {**row, "first_token_s": None})  # the first token seen later, as an update
    for row in TIMELINE_SHARDS[:4]:
        store.add("shards", row)
    store.flush()
    for row in starts[3:]:
        store.add("actors", row)
    for row in TIMELINE_SHARDS[4:]:
        store.add("shards", row)
    store.add(FIRST_TOKENS, {"actor_id": ACTOR_A, "start_index": 1, "first_token_s": 0.5})
    store.flush()
    before = sorted(p.relative_to(running) for p in running.rglob("*"))
    assert len(list((running / "telemetry/.pending").iterdir())) == 5

    page = write_report(str(running), str(tmp_path / "running.html")).read_text()
    for table_id in ("timeline-actors", "startup-phases", "runs"):
        assert _table_rows(page, table_id) == _table_rows(folded, table_id), table_id
    assert "nor parts of it yet" not in page
    assert sorted(p.relative_to(running) for p in running.rglob("*")) == before


def test_timeline_figure_draws_the_measured_intervals():
    starts, shards = TIMELINE_STARTS[1:], TIMELINE_SHARDS[1:-1]  # the last run's timed rows
    lanes = report_timeline.lanes(starts, shards, T0)
    assert lanes[0].running == {"tiny-a": [(40.0, 120.0), (170.0, 230.0), (240.0, 250.0)]}
    assert lanes[1].running == {"tiny-b": [(80.0, 140.0)], "tiny-c": [(160.0, 220.0)]}
    fig = report_timeline.draw(lanes, {}, report_timeline.run_markers(RUNS[1]), "s")
    ax = fig.axes[0]
    bars = {}
    for c in ax.collections:
        bars.setdefault(c.get_gid(), []).extend((p.vertices[:, 0].min(), p.vertices[:, 0].max())
                                                for p in c.get_paths())
    assert sorted(bars[f"running {ACTOR_A}"]) == [(40, 120), (170, 230), (240, 250)]
    assert sorted(bars[f"starting {ACTOR_B}"]) == [(10, 70), (140, 160)]
    assert sorted(bars[f"idle {ACTOR_A}"]) == [(120, 150), (230, 240)]
    assert bars[f"waiting {ACTOR_A}"] == [(25, 31)] and bars[f"waiting {ACTOR_B}"] == [(40, 45)]
    assert sorted(line.get_xdata()[0] for line in ax.lines) == [0, 8, 100, 250]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "starting (engine start-up)", "starting: waiting for a model", "idle", "running tiny-a", "running tiny-b",
        "running tiny-c", "driver start", "planning done", "first result", "last result"]


def test_startup_shows_the_phase_columns(timeline_output):
    page = write_report(str(timeline_output)).read_text()
    phases = {r[0]: r[1:] for r in _table_rows(page, "startup-phases")}
    # startup_s, process_s, imports_s, waiting_s, engine_init_s, load_s, weights_s, core_init_s, compile_s,
    # profile_run_s, graph_capture_s, warmup_s, first_token_s
    assert phases["tiny-a · a1a1a1a1 #1 (first)"] == ["30.000", "5.000", "10.000", "6.000", "6.000", "—", "—", "—",
                                                       "—", "—", "—", "2.000", "0.500"]
    assert phases["tiny-a · a1a1a1a1 #2 (profile)"] == ["20.000", "—", "—", "—", "15.000", "—", "—", "—", "—", "—",
                                                         "—", "5.000", "—"]
    assert 'alt="engine start-up time by phase"' in _section_html(page, "startup")
    widths = _phase_widths(TIMELINE_STARTS[1:3])  # A's first start and its profile restart
    assert list(widths) == ["process", "imports", "waiting", "engine_init", "warmup",
                            "rest of startup_s (in no measured step)", "first token (after ready)"]  # no load_s etc.
    assert math.isnan(widths["process"][1]), "a later start has no process step: NaN (no bar), not 0"
    assert widths["rest of startup_s (in no measured step)"][0] == pytest.approx(1.0)  # 30 - (5 + 10 + 6 + 6 + 2)
    # a vLLM engine whose start-up report gave its steps: its construction drawn as them, the other start's whole
    vllm = [{**TIMELINE_STARTS[1], "engine_init_s": 84.5, "weights_s": 8.0, "core_init_s": 60.5},
            TIMELINE_STARTS[2]]
    steps = _phase_widths(vllm)
    assert list(steps)[3:7] == ["engine_init", "engine_init: before the weights (config, engine core start)",
                                "engine_init: weights", "engine_init: engine core's init (compile, profile, KV cache, "
                                "graphs)"]
    assert [steps[k][0] for k in list(steps)[4:7]] == pytest.approx([16.0, 8.0, 60.5])
    assert math.isnan(steps["engine_init"][0]) and steps["engine_init"][1] == 15.0
    assert math.isnan(steps["engine_init: weights"][1])


def test_timeline_of_an_older_output_says_what_is_missing(sweep_output):
    section = _section_html(write_report(str(sweep_output)).read_text(), "timeline")
    assert "has no requested_at/ready_at" in section and "manifest.json has no `runs`" in unescape(section)
    # running from shard times only: A ran 09:01-09:02 and 09:03-09:04, B 09:02-09:03; no start measured
    assert _table_rows(section, "timeline-actors") == [
        ["tiny-a · a1a1a1a1", "1", "—", "—", "120.000", "60.000", "33.3%", "0.000"],
        ["tiny-b · b2b2b2b2", "1", "—", "—", "60.000", "0.000", "0.0%", "60.000"]]  # B's last shard ended 09:03
    assert "<img" in section


def test_timeline_with_no_timed_telemetry_draws_nothing(sweep_output):
    failed = [{"shard_id": FAILED_SHARD, "attempt": 1, "error": "ActorDiedError: actor a1a1 died"}]
    pq.write_table(pa.Table.from_pylist(failed), sweep_output / "telemetry/shards.parquet")
    section = _section_html(write_report(str(sweep_output)).read_text(), "timeline")
    assert "Nothing to draw" in section and "<img" not in section


# -- as a browser shows it ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed here once if absent (we run as root); a failed install fails the test."""
    if shutil.which("chromium") is None:
        env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}  # apt must not wait on a prompt
        proc = subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, env=env,
                              capture_output=True, text=True, timeout=1200, check=False)
        if proc.returncode != 0 or shutil.which("chromium") is None:
            pytest.fail(f"installing chromium failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                        f"{proc.stderr[-4000:]}")
    return shutil.which("chromium")


def _chromium(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: Chromium refuses to sandbox as root; a fresh profile dir keeps runs independent
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={profile}", "--window-size=1280,2000", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def test_report_renders_in_headless_chromium(chromium, sweep_output, tmp_path):
    page = write_report(str(sweep_output))
    shot = tmp_path / "report.png"
    _chromium(chromium, tmp_path / "profile", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1280)
    assert pixels.std() > 0.05 and (pixels.mean(axis=2) < 0.9).mean() > 0.02, "the screenshot is blank"

    # the DOM once the page's script has run: the comparison, and the sample browser's first task drawn
    dom = _chromium(chromium, tmp_path / "profile", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()).stdout
    assert _table_rows(dom, "scores")[1][:4] == ["tiny-b", "choice", "4", "4"]
    assert _comparison(dom)[("choice", "score")]["tiny-b"][2] == "0.667 ± 0.333"
    assert dom.count("<img") == 5
    assert "7 row(s) in this task, 0 where the columns disagree; all are in this page, 7 match the filters." in dom
    browser = re.search(r'<table id="sample-browser">(.*?)</table>', dom, re.DOTALL).group(1)
    drawn = re.findall(r"<tr[^>]*>(.*?)</tr>", browser.split("<tbody>")[1], re.DOTALL)
    assert len(drawn) == 7 and "arith-0-2" in drawn[0]  # the rows not ok first: the error row, then the truncated
    assert "CUDA error: &lt;boom&gt; &amp; co" in drawn[0]


# -- raysweep models, raysweep spec-reference ---------------------------------------------------------
def test_models_lists_each_builtin_with_the_size_a_built_one_has(tiny_path, capsys):
    from safetensors import safe_open

    from cluster.inputs.builtin_model import CONFIGS
    from jobs.cli import builtin_parameters

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == [f"builtin:{name}" for name in CONFIGS]
    assert lines[1].split()[1:8] == ["3.2M", "4", "256", "4", "264", "32768", "12"]
    assert lines[1].endswith(tiny_path)  # built by the fixture, so listed as cached
    with safe_open(Path(tiny_path) / "model.safetensors", "np") as f:  # the count, against the real model
        built = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    config = json.loads((Path(tiny_path) / "config.json").read_text())
    assert builtin_parameters(CONFIGS["tiny"]) == (built, config["vocab_size"])


def test_committed_spec_reference_is_what_the_spec_code_generates(capsys):
    from jobs.spec_reference import render

    committed = (Path(__file__).resolve().parent.parent / "sweeps" / "REFERENCE.md").read_text()
    assert main(["spec-reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == render()
    assert committed == printed, ("sweeps/REFERENCE.md is out of date with cluster/contracts/spec.py; regenerate it: "
                                  "raysweep spec-reference > sweeps/REFERENCE.md")
    for section in ("## Top level", "## `models[]`", "## `tasks[]`", "## `tasks[].sampling`", "## `actors`"):
        assert section in printed
    from cluster.contracts.spec import LENGTH_POLICIES, SCORERS

    assert all(f"`{name}`" in printed for name in SCORERS + LENGTH_POLICIES)
