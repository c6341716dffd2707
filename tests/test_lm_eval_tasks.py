"""lm-evaluation-harness tasks in a spec (docs/lm-eval.md), against lm-eval's own run.

The reference is `lm_eval --model hf` on builtin:tiny (CPU, float32) over three local task YAMLs whose data
the test writes (`dataset_path: json`): a multiple-choice task with 2-shot contexts, a `generate_until` task
with GSM8K's two regex filters, and a `loglikelihood_rolling` task whose longer documents need several
windows. raysweep runs the same tasks from a spec's `lm_eval:` entry; per-document records and aggregated
metrics (with stderr) must be lm-eval's.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.contracts.spec import SpecError
from tests.conftest import LM_EVAL, ROOT

pytest.importorskip("lm_eval")

MAX_MODEL_LEN = 400  # raysweep's windows are max_model_len - 2 tokens, as lm-eval's vLLM model's
# documents of the multiple-choice and generate_until tasks: each is compared record by record with lm-eval's, and
# each costs forward passes of the CPU model in every lm-eval and raysweep run of the tests that use them
MC_DOCS, GEN_DOCS = 12, 8
# with non-ASCII words: acc_norm (characters) and acc_bytes (UTF-8 bytes) can tell them apart
WORDS = "alpha beta gamma delta river stone cloud paper silver green seven music table café 서울 東京".split()


def _phrase(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))


def write_tasks(folder: Path) -> Path:
    """Data and task YAMLs under `folder`; returns the include_path."""
    rng = random.Random(0)
    data = folder / "data"
    data.mkdir(parents=True)
    for name, n in (("mc_test", MC_DOCS), ("mc_train", 8)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({
            "question": _phrase(rng) + "?", "choices": [_phrase(rng) for _ in range(4)], "label": rng.randrange(4)})
            + "\n" for _ in range(n)))
    sums = [(rng.randrange(20), rng.randrange(20)) for _ in range(GEN_DOCS)]
    (data / "gen_test.jsonl").write_text("".join(json.dumps({
        "question": f"What is {a} plus {b}?", "answer": f"{a} plus {b} is #### {a + b}"}) + "\n" for a, b in sums))
    texts = [" ".join(_phrase(rng) for _ in range(rng.randint(1, 30))) for _ in range(10)]
    texts[0] = texts[0] * 3  # at least one document of several windows
    texts[1] = ""  # an empty document: no windows, lm-eval's models give it 0
    (data / "ppl_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tasks = folder / "tasks"
    tasks.mkdir()
    source = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}/%s_test.jsonl\n"
    (tasks / "rs_mc.yaml").write_text(f"task: rs_mc\n{source % 'mc'}    train: {data}/mc_train.jsonl\n" + textwrap.dedent("""\
        test_split: test
        fewshot_split: train
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: label
        metric_list:
          - {metric: acc, aggregation: mean, higher_is_better: true}
          - {metric: acc_norm, aggregation: mean, higher_is_better: true}
        """))
    # the same documents 0-shot (a task's own num_fewshot: 0 is kept whatever --num_fewshot says): the
    # reference of a native `type: loglikelihood` task over mc_test.jsonl
    (tasks / "rs_mc0.yaml").write_text((tasks / "rs_mc.yaml").read_text().replace("task: rs_mc\n", "task: rs_mc0\nnum_fewshot: 0\n")
                                       + "  - {metric: acc_bytes, aggregation: mean, higher_is_better: true}\n")
    (tasks / "rs_gen.yaml").write_text(f"task: rs_gen\n{source % 'gen'}" + textwrap.dedent("""\
        test_split: test
        output_type: generate_until
        doc_to_text: "Q: {{question}}\\nA:"
        doc_to_target: "{{answer.split('####')[-1].strip()}}"
        generation_kwargs: {until: ["\\n\\n", "Q:"], max_gen_toks: 12, do_sample: false}
        filter_list:
          - name: strict-match
            filter:
              - {function: regex, regex_pattern: "#### (\\\\-?[0-9]+)"}
              - {function: take_first}
          - name: flexible-extract
            filter:
              - {function: regex, group_select: -1, regex_pattern: "(-?[0-9]+)"}
              - {function: take_first}
        metric_list:
          - {metric: exact_match, aggregation: mean, higher_is_better: true}
        """))
    (tasks / "rs_ppl.yaml").write_text(f"task: rs_ppl\n{source % 'ppl'}" + textwrap.dedent("""\
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - {metric: word_perplexity}
          - {metric: byte_perplexity}
          - {metric: bits_per_byte}
        """))
    return tasks


def write_spec(folder: Path, lm_eval: dict, name: str = "lmt", native: tuple = ()) -> Path:
    spec = folder / f"{name}.yaml"
    spec.write_text(json.dumps({"name": name, "output": str(folder / "out"),
                                "models": [{"name": "tiny", "path": "builtin:tiny",
                                            "engine": {"max_model_len": MAX_MODEL_LEN}}],
                                "tasks": [{"lm_eval": lm_eval}, *native]}))
    return spec


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


def _env(ray=None) -> dict:
    """A command's environment: lm-eval offline. With `ray` (tests/conftest.py ray_local) the command joins the
    session's local Ray instead of starting one with its reaper and early engine host: 4-5 CPU-seconds less a
    command (10.4-11.5 against 14.5-16.2 for this file's three tasks, idle 2-core machine), which the suite's other
    worker has to itself. Tests of lm-eval's side join; a command's own local Ray with lm-eval is tested where it is
    the point: the first run of test_lm_eval_tasks_give_lm_evals_own_numbers, the test of Ray starting while
    lm-eval builds its tasks, tests/test_lifecycle.py's, and tests/test_lm_eval_command.py's Ctrl-C and hub
    dataset tests."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if ray is not None:
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    return env


def compare(reference: Path, ours: Path, tasks=("rs_mc", "rs_gen", "rs_ppl")) -> dict:
    """lm-eval's files against raysweep's: aggregated metrics and stderr to 1e-6, every per-document record's
    arguments, responses and metrics; returns the number of records per task."""
    ref = json.loads(Path(glob.glob(f"{reference}/results_*.json")[0]).read_text())
    got = json.loads(Path(glob.glob(f"{ours}/results_*.json")[0]).read_text())
    for key in ("tokenizer_pad_token", "tokenizer_eos_token", "tokenizer_bos_token", "eot_token_id"):
        assert got[key] == ref[key], key  # the model's tokenizer, as lm-eval's hf model records it
    assert isinstance(got["max_length"], int)  # its engines' max_model_len (hf's is its own rule)
    counts = {}
    for task in tasks:
        values = ref["results"][task]
        for key, value in values.items():
            mine = got["results"][task][key]
            if isinstance(value, float):
                assert mine == pytest.approx(value, rel=1e-6, abs=1e-6), (task, key)
            else:
                assert mine == value, (task, key)
        assert got["n-samples"][task] == ref["n-samples"][task]
        records = [[json.loads(line) for line in Path(glob.glob(f"{d}/samples_{task}_*.jsonl")[0]).read_text().splitlines()]
                   for d in (reference, ours)]
        assert len(records[0]) == len(records[1])
        order = lambda r: (r["filter"], r["doc_id"])  # noqa: E731
        for a, b in zip(sorted(records[0], key=order), sorted(records[1], key=order)):
            assert (a["doc_id"], a["arguments"], a["target"], a["filter"]) == (b["doc_id"], b["arguments"], b["target"], b["filter"])
            for metric in a["metrics"]:
                assert b[metric] == pytest.approx(a[metric], rel=1e-5, abs=1e-5), (task, a["doc_id"], metric)
            if task == "rs_gen":
                assert a["resps"] == b["resps"] and a["filtered_resps"] == b["filtered_resps"]
        counts[task] = len(records[0])
    return counts


def lm_eval_reference(include_path: Path, out: Path, tiny_path: str) -> Path:
    """lm-eval's own run: `lm_eval --model hf` on the CPU, float32 (tests/lm_eval_reference.py); max_length is
    raysweep's window."""
    subprocess.run(
        [*LM_EVAL, "--model", "hf", "--model_args",
         f"pretrained={tiny_path},dtype=float32,max_length={MAX_MODEL_LEN - 2}", "--tasks", "rs_mc,rs_gen,rs_ppl,rs_mc0",
         "--include_path", str(include_path), "--num_fewshot", "2", "--device", "cpu", "--batch_size", "8",
         "--output_path", str(out), "--log_samples"],
        check=True, env=_env(), capture_output=True, text=True, timeout=600)
    return Path(glob.glob(f"{out}/*/results_*.json")[0]).parent


@pytest.mark.slow
def test_lm_eval_tasks_give_lm_evals_own_numbers(include_path, tmp_path, tiny_path, ray_local):
    # beside the lm_eval: entry, a native multiple-choice task over rs_mc0's documents, written as a user
    # would write it (bare choices, the default target_delimiter)
    native = {"name": "mc_native", "type": "loglikelihood", "data": str(include_path.parent / "data" / "mc_test.jsonl"),
              "prompt": "Question: {question}\nAnswer:", "choices": "choices", "target": "label"}
    spec = write_spec(tmp_path, {"tasks": ["rs_mc", "rs_gen", "rs_ppl"], "include_path": str(include_path),
                                 "num_fewshot": 2}, native=(native,))
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "fatal:" not in run.stderr  # lm-eval's own noise kept out
    reference = lm_eval_reference(include_path, tmp_path / "reference", tiny_path)
    ours = tmp_path / "out" / "lm_eval" / "tiny"
    counts = {"rs_mc": MC_DOCS, "rs_gen": 2 * GEN_DOCS, "rs_ppl": 10}  # rs_gen: a record per document and filter
    assert compare(reference, ours) == counts

    import pyarrow.parquet as pq

    summary = {r["task"]: r for r in pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()}
    results = json.loads(next(ours.glob("results_*.json")).read_text())["results"]
    assert summary["rs_mc"]["score"] == pytest.approx(results["rs_mc"]["acc,none"])
    assert summary["rs_mc"]["stderr"] == pytest.approx(results["rs_mc"]["acc_stderr,none"])
    metrics = {m["name"]: m for m in summary["rs_gen"]["metrics"]}
    assert metrics["exact_match,flexible-extract"]["value"] == pytest.approx(
        results["rs_gen"]["exact_match,flexible-extract"])
    samples = pq.read_table(ours / "samples_rs_mc.parquet").to_pylist()
    assert sorted(r["doc_id"] for r in samples) == list(range(MC_DOCS)) and {"acc", "acc_norm"} <= set(samples[0])
    rows = pq.read_table(tmp_path / "out" / "results").to_pylist()
    mc = next(r for r in rows if r["task"] == "rs_mc" and r["sample_id"] == "0")
    assert mc["prompt"].count("Question:") == 3 and mc["prompt"].endswith("Answer:")  # 2 shots, then the question
    assert len(mc["choice_logprobs"]) == 4
    ppl = [r for r in rows if r["task"] == "rs_ppl"]
    assert max(len(r["prompt"] or "") for r in ppl) == 0  # a rolling row's text is its one choice
    # the longest document needed several windows (a byte-level tokenizer: a token per byte)
    assert max(len(json.loads(line)["text"].encode()) for line in
               (include_path.parent / "data" / "ppl_test.jsonl").read_text().splitlines()) > MAX_MODEL_LEN - 2

    # the native task is lm-eval's 0-shot rs_mc0: each choice's log-likelihood, acc, acc_norm and acc_bytes
    reference_mc0 = {r["doc_id"]: r for r in map(json.loads, open(glob.glob(f"{reference}/samples_rs_mc0_*.jsonl")[0]))}
    mine = {int(r["sample_id"]): r for r in rows if r["task"] == "mc_native"}
    assert sorted(mine) == sorted(reference_mc0) == list(range(MC_DOCS))
    for doc, r in mine.items():
        ref = reference_mc0[doc]
        assert r["choice_logprobs"] == pytest.approx([float(x[0][0]) for x in ref["resps"]], abs=2e-4)
        assert (r["score"], r["score_norm"], r["score_bytes"]) == (ref["acc"], ref["acc_norm"], ref["acc_bytes"])
    ref_mc0 = json.loads(next(reference.glob("results_*.json")).read_text())["results"]["rs_mc0"]
    native_metrics = {m["name"]: m["value"] for m in summary["mc_native"]["metrics"]}
    assert summary["mc_native"]["score"] == pytest.approx(ref_mc0["acc,none"])
    assert native_metrics == pytest.approx({"acc_norm": ref_mc0["acc_norm,none"], "acc_bytes": ref_mc0["acc_bytes,none"]})

    again = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "0 shards run, 4 already committed" in again.stdout, again.stdout[-1500:]

    # lm-eval's command line, raysweep as its model, two actors: the same files, the same numbers
    cli = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", "--model_args",
         f"pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=2,output={tmp_path / 'lm-eval-runs'}",
         "--tasks", "rs_mc,rs_gen,rs_ppl", "--include_path", str(include_path), "--num_fewshot", "2",
         "--output_path", str(tmp_path / "via-cli"), "--log_samples"],
        cwd=ROOT, env=_env(ray_local), capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout[-1500:] + cli.stderr[-1500:]
    assert compare(reference, tmp_path / "via-cli" / "builtin__tiny") == counts
    assert f"planned tiny/rs_mc: {MC_DOCS} samples" in cli.stderr
    # three request types, three sweeps, engines started by the first only: its actors run the next two
    first, kept, later = cli.stderr.partition("engines kept from this process's last sweep run model(s) tiny")
    assert "engine up: model tiny" in first and kept and "engine up:" not in later, cli.stderr[-3000:]
    assert later.count("engines kept from this process's last sweep run model(s) tiny") == 1


RAISING = """
def process_results(doc, results):
    lls = [ll for ll, _ in results]
    if all(ll == 0.0 for ll in lls):  # the placeholders of the pass that builds the requests
        return {"acc": 0.0}
    raise ValueError("cannot score these answers")
"""
FIXED = """
def process_results(doc, results):
    lls = [ll for ll, _ in results]
    return {"acc": float(lls.index(max(lls)) == doc["label"])}
"""


@pytest.mark.slow
def test_a_task_whose_process_results_raises_fails_alone_and_a_fixed_one_scores_without_engines(tmp_path, ray_local):
    """A `process_results` that raises on real answers ended the run in a traceback, rc 1, no summary and no lm-eval
    files, and every re-run the same. The task is failed alone (one line naming it and the exception, its summary
    row's error, rc 1); its neighbour's lm-eval files and summary are written; once the task is fixed, the same
    command scores it from the committed rows, no shard run again."""
    import pyarrow.parquet as pq

    tasks = write_tasks(tmp_path / "lm")
    (tasks / "utils.py").write_text(RAISING)
    (tasks / "rs_bad.yaml").write_text((tasks / "rs_mc.yaml").read_text().replace("task: rs_mc\n", "task: rs_bad\n")
                                       .split("metric_list:")[0] + "process_results: !function utils.process_results\n"
                                       "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    spec = write_spec(tmp_path, {"tasks": ["rs_mc", "rs_bad"], "include_path": str(tasks), "limit": 6})
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                         capture_output=True, text=True, timeout=600)
    said = run.stdout + run.stderr
    assert run.returncode == 1, said[-3000:]
    why = "lm-eval task rs_bad: its process_results raised ValueError: cannot score these answers"
    assert f"[raysweep] FAILED task tiny/rs_bad: {why}" in run.stdout and "Traceback" not in said, said[-3000:]
    summary = {r["task"]: r for r in pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()}
    assert summary["rs_bad"]["error"] == why and summary["rs_bad"]["score"] is None
    assert summary["rs_mc"]["error"] is None and summary["rs_mc"]["score"] is not None
    ours = tmp_path / "out" / "lm_eval" / "tiny"
    results = json.loads(next(ours.glob("results_*.json")).read_text())["results"]
    assert "rs_mc" in results and "rs_bad" not in results and (ours / "samples_rs_mc.parquet").exists()

    (tasks / "utils.py").write_text(FIXED)
    again = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "(0 shards run, 2 already committed)" in again.stdout and "engine up:" not in again.stdout + again.stderr
    summary = {r["task"]: r for r in pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()}
    assert summary["rs_bad"]["error"] is None and summary["rs_bad"]["score"] == summary["rs_mc"]["score"]


def _load(spec: Path):
    from cluster.inputs.spec_file import load_spec

    return load_spec(spec)


def refusal(spec: Path) -> str:
    """The one line loading `spec` is refused with."""
    with pytest.raises(SpecError) as e:
        _load(spec)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_unknown_lm_eval_task_is_named_with_lm_evals_closest(include_path, tmp_path):
    message = refusal(write_spec(tmp_path, {"tasks": ["rs_mcc"], "include_path": str(include_path)}))
    assert "tasks[0].lm_eval.tasks: 'rs_mcc' is not an lm-eval task or group" in message and "rs_mc" in message


@pytest.mark.slow
def test_a_sweep_starts_ray_while_lm_eval_builds_its_tasks_and_a_bad_task_stops_it_again(include_path, tmp_path):
    """lm-eval's tasks took seconds to build before Ray began its start (bench/records/h200-warm-pool-and-lm-eval-ray-start.md); now Ray
    starts meanwhile, and an input lm-eval refuses still ends in its one line, with no Ray process left behind."""
    import shutil
    import tempfile

    from tests.test_signals import _raylets

    spec = write_spec(tmp_path, {"tasks": ["rs_mcc"], "include_path": str(include_path)})
    ray_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # the run's own Ray folder: its raylets are told apart
    try:
        done = subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec)], cwd=ROOT, capture_output=True, text=True,
                              timeout=180, env=_env() | {"RAY_ADDRESS": "", "RAY_TMPDIR": ray_dir})
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        assert "[raysweep] starting a local Ray" in done.stdout  # the start began before the spec was refused
        assert done.stderr.startswith("raysweep: error: ") and done.stderr.count("\n") == 1, done.stderr[-2000:]
        assert "'rs_mcc' is not an lm-eval task or group" in done.stderr
        assert not _raylets(ray_dir)  # the Ray it started is gone with it
        assert not (tmp_path / "out").exists()
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_a_dataset_that_cannot_be_loaded_names_the_task_and_how_to_read_data_offline(include_path, tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "gone.yaml").write_text(textwrap.dedent(f"""\
        task: rs_gone
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {tmp_path}/missing.jsonl}}}}
        test_split: test
        output_type: loglikelihood
        doc_to_text: "{{{{q}}}}"
        doc_to_target: "{{{{a}}}}"
        """))
    message = refusal(write_spec(tmp_path, {"tasks": ["rs_gone"], "include_path": "tasks"}))
    assert "'rs_gone': lm-eval could not load the dataset" in message and "HF_DATASETS_OFFLINE" in message


def test_settings_are_checked_by_name(include_path, tmp_path):
    for settings, said in (({"tasks": ["rs_mc"], "num_fewshots": 2}, "tasks[0].lm_eval.num_fewshots: not a setting "
                                                                     "(did you mean 'num_fewshot'?)"),
                           ({"tasks": ["rs_mc"], "limit": -1}, "tasks[0].lm_eval.limit: documents per task"),
                           ({"tasks": []}, "tasks[0].lm_eval.tasks: lm-eval task or group names"),
                           ({"tasks": ["rs_mc"], "include_path": "nowhere"}, "tasks[0].lm_eval.include_path: ")):
        with pytest.raises(SpecError, match="^" + re.escape(f"{tmp_path}/lmt.yaml: {said}")):
            _load(write_spec(tmp_path, settings))


def test_lm_eval_not_installed_names_the_extra(tmp_path):
    spec = write_spec(tmp_path, {"tasks": ["arc_easy"]})
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "from cluster.inputs.spec_file import load_spec\n"
            "from cluster.contracts.spec import SpecError\n"
            f"try:\n    load_spec({str(spec)!r})\nexcept SpecError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "tasks[0].lm_eval: lm-eval is not installed" in out.stdout and "raysweep[lm-eval]" in out.stdout, out


def test_a_task_whose_requests_are_of_several_types_is_refused():
    from cluster.contracts.lm_eval_task import LmEvalSettings
    from cluster.lm_eval.run import request_rows
    from cluster.lm_eval.requests import task_spec

    requests = [SimpleNamespace(task_name="mixed", doc_id=0, idx=0, request_type="loglikelihood", args=("Q", " a"),
                                repeats=1),
                SimpleNamespace(task_name="mixed", doc_id=0, idx=1, request_type="generate_until",
                                args=("Q", {"until": ["\n"]}), repeats=1)]
    with pytest.raises(ValueError, match="mixed: its documents make requests of several types "
                                         r"\(generate_until, loglikelihood\); raysweep serves a task of one type"):
        task_spec("mixed", requests, request_rows(requests)["mixed"], LmEvalSettings(tasks=("mixed",)), 0)


def test_request_rows_group_a_documents_choices_and_split_differing_contexts():
    from cluster.lm_eval.run import request_rows

    def req(doc, idx, ctx, cont):
        return SimpleNamespace(task_name="t", doc_id=doc, idx=idx, request_type="loglikelihood", args=(ctx, cont))

    rows = request_rows([req(0, 0, "Q:", " a"), req(0, 1, "Q:", " b"), req(1, 1, "The cat", " sat"),
                         req(1, 0, "The dog", " sat")])["t"]
    assert rows == [({"id": "0", "context": "Q:", "choices": [" a", " b"], "target": 0}, [(0, 0, 0), (0, 1, 1)]),
                    ({"id": "1.0", "context": "The dog", "choices": [" sat"], "target": 0}, [(1, 0, 0)]),
                    ({"id": "1.1", "context": "The cat", "choices": [" sat"], "target": 0}, [(1, 1, 0)])]


def test_rolling_windows_are_lm_evals():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from cluster.contracts.loglikelihood import rolling_length, rolling_windows

    rng = random.Random(0)
    for n in range(40):
        for window in (1, 2, 3, 7, 16):
            tokens = [rng.randrange(50) for _ in range(n)]
            expected = [tuple(map(list, make_disjoint_window(p))) for p in get_rolling_token_windows(tokens, 99, window, 1)]
            assert rolling_windows(tokens, 99, window) == expected
            assert max((len(c) + len(x) for c, x in expected), default=0) == rolling_length(n, window)


@pytest.mark.slow
def test_chat_templated_lm_eval_tasks_give_lm_evals_own_numbers(include_path, tmp_path, tiny_path, ray_local):
    """apply_chat_template with few-shot examples as turns and a system instruction: the requests rendered by
    builtin:tiny's chat template as lm-eval's HF model renders them, the same records and metrics."""
    spec = write_spec(tmp_path, {"tasks": ["rs_mc", "rs_gen"], "include_path": str(include_path), "num_fewshot": 2,
                                 "apply_chat_template": True, "fewshot_as_multiturn": True,
                                 "system_instruction": "Be brief."})
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    subprocess.run(
        [*LM_EVAL, "--model", "hf", "--model_args",
         f"pretrained={tiny_path},dtype=float32,max_length={MAX_MODEL_LEN - 2}", "--tasks", "rs_mc,rs_gen",
         "--include_path", str(include_path), "--num_fewshot", "2", "--apply_chat_template", "--fewshot_as_multiturn",
         "--system_instruction", "Be brief.", "--device", "cpu", "--batch_size", "8",
         "--output_path", str(tmp_path / "reference"), "--log_samples"],
        check=True, env=_env(), capture_output=True, text=True, timeout=600)
    reference = Path(glob.glob(f"{tmp_path / 'reference'}/*/results_*.json")[0]).parent
    assert compare(reference, tmp_path / "out" / "lm_eval" / "tiny", tasks=("rs_mc", "rs_gen")) == \
        {"rs_mc": MC_DOCS, "rs_gen": 2 * GEN_DOCS}
    import pyarrow.parquet as pq

    prompt = pq.read_table(tmp_path / "out" / "results" / "tiny" / "rs_gen").column("prompt")[0].as_py()
    assert "Be brief." in prompt and prompt.count("Q: ") == 3  # the system message, 2 shots as turns, the question


def test_a_group_gets_a_summary_row_with_lm_evals_aggregate():
    """lm-eval's group aggregate (results["groups"]) becomes a summary row of its own, its counts summed over
    its tasks' rows; each task's row carries lm-eval's metrics."""
    import pyarrow as pa

    from cluster.lm_eval.scores import merge_summary
    from cluster.score.summary import SUMMARY_SCHEMA

    rows = [{"model": "m", "task": t, "n": 6, "n_samples": 6, "n_ok": 6, "n_truncated": 0, "n_skipped": 0, "n_error": 0,
             "output_tokens": 0, "metrics": []} for t in ("a", "b")]
    summary = pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)
    metrics = {("m", "a"): {"acc,none": 0.5, "acc_stderr,none": 0.2, "documents": 6},
               ("m", "b"): {"acc,none": 0.25, "acc_stderr,none": 0.1, "documents": 6},
               ("m", "g"): {"acc,none": 0.375, "acc_stderr,none": 0.12, "acc_norm,none": 0.4,
                            "acc_norm_stderr,none": "N/A", "subtasks": ["a", "b"], "documents": 12}}
    got = {r["task"]: r for r in merge_summary(summary, metrics).to_pylist()}
    assert list(got) == ["a", "b", "g"]
    assert (got["g"]["n"], got["g"]["n_samples"], got["g"]["n_ok"]) == (12, 12, 12)
    assert (got["g"]["score"], got["g"]["stderr"]) == (0.375, 0.12)
    assert got["g"]["metrics"] == [{"name": "acc", "value": 0.375, "stderr": 0.12, "n": 12},
                                   {"name": "acc_norm", "value": 0.4, "stderr": None, "n": 12}]
    assert got["a"]["score"] == 0.5 and got["b"]["stderr"] == 0.1


@pytest.mark.slow
def test_a_multiple_choice_context_too_long_is_cut_as_lm_eval_cuts_it(include_path, tmp_path, tiny_path, ray_local):
    """3-shot contexts over a max_model_len of 300: each choice is scored on the context's last tokens that fit,
    as lm-eval's HF model keeps (context + choice)[-(max_length + 1):] (max_length = 300 - 2, raysweep's window);
    the rows are `truncated`, and the records and metrics are lm-eval's."""
    spec = tmp_path / "cut.yaml"
    spec.write_text(json.dumps({"name": "cut", "output": str(tmp_path / "out"),
                                "models": [{"name": "tiny", "path": "builtin:tiny", "engine": {"max_model_len": 300}}],
                                "tasks": [{"lm_eval": {"tasks": ["rs_mc"], "include_path": str(include_path),
                                                       "num_fewshot": 3, "limit": 10}}]}))
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    subprocess.run(
        [*LM_EVAL, "--model", "hf", "--model_args",
         f"pretrained={tiny_path},dtype=float32,max_length=298", "--tasks", "rs_mc", "--include_path", str(include_path),
         "--num_fewshot", "3", "--limit", "10", "--device", "cpu", "--batch_size", "8",
         "--output_path", str(tmp_path / "reference"), "--log_samples"],
        check=True, env=_env(), capture_output=True, text=True, timeout=600)
    reference = Path(glob.glob(f"{tmp_path / 'reference'}/*/results_*.json")[0]).parent
    assert compare(reference, tmp_path / "out" / "lm_eval" / "tiny", tasks=("rs_mc",)) == {"rs_mc": 10}
    import pyarrow.parquet as pq

    statuses = pq.read_table(tmp_path / "out" / "results", columns=["status"]).column("status").to_pylist()
    assert statuses.count("truncated") >= 5  # most 3-shot contexts are over 299 tokens here


def test_templates_compiled_once_render_as_lm_eval_and_compile_each_template_once(monkeypatch):
    import lm_eval.utils as utils

    from cluster.lm_eval.adapter import templates_compiled_once

    docs = [{"question": f"q{i}", "choices": ["a", "b"], "label": i % 2} for i in range(50)]
    templates = ["Question: {{question}}\nAnswer:", "{{choices[label]}}", "{{question | regex_replace('q', 'Q')}}"]
    expected = [utils.apply_template(t, d) for d in docs for t in templates]  # lm-eval's own function
    original = utils.apply_template
    compiles = []
    from_string = utils.env.from_string
    monkeypatch.setattr(utils.env, "from_string", lambda source: compiles.append(source) or from_string(source))
    with templates_compiled_once():
        assert [utils.apply_template(t, d) for d in docs for t in templates] == expected
    assert sorted(compiles) == sorted(templates)  # 150 renders, 3 compiles
    assert utils.apply_template is original


@pytest.fixture
def models_without_ray(monkeypatch):
    """RaysweepLM's class, its models made in one run: making a model starts no Ray and no engine host (lm-eval
    has not loaded its tasks yet); the run closed after the test."""
    from jobs.lm_eval_model import RaysweepLM
    from jobs.lm_eval_run import LmEvalRun

    with LmEvalRun() as run:
        yield RaysweepLM
        assert run.life is None or (run.life.host is None and not run.life.ray_begun)


def test_lm_eval_model_args_leave_the_engines_per_gpu_to_raysweep_unless_given(models_without_ray):
    """`--model raysweep` without actors/num_gpus chooses them as a spec without `actors:` does (on a large GPU:
    two engines for a small model); given values are kept."""
    from cluster.contracts.spec import ActorSpec

    RaysweepLM = models_without_ray
    assert RaysweepLM(pretrained="builtin:tiny").actors == ActorSpec()
    assert RaysweepLM(pretrained="builtin:tiny").model.loglikelihood  # its engines keep vLLM's compiled default
    assert RaysweepLM(pretrained="builtin:tiny", actors="auto", num_gpus="AUTO").actors == ActorSpec()
    given = RaysweepLM(pretrained="builtin:tiny", actors="2", num_gpus="0.5").actors
    assert (given.count, given.num_gpus) == (2, 0.5)
    with pytest.raises(ValueError, match="num_gpus must be auto or a number, got 'half'"):
        RaysweepLM(pretrained="builtin:tiny", num_gpus="half")


def test_lm_eval_model_args_that_cannot_be_used_are_one_line_at_the_edge(models_without_ray):
    """`actors=0` ended in ValueError's traceback (`count: must be an integer >= 1`); `dtype=float32` and
    `max_length=50` were ignored while lm-eval's header printed them."""
    from cluster.contracts.errors import RaysweepError

    RaysweepLM = models_without_ray
    for args, says in [({"actors": "0"}, "--model_args: actors: must be an integer >= 1, got 0"),
                       ({"max_model_len": "0"}, "--model_args: max_model_len: must be an integer >= 1, got 0"),
                       ({"max_model_len": "long"}, "--model_args: max_model_len must be auto or an integer, got 'long'"),
                       # lm-eval reads `actors=2.9` as a float: int() ran 2 actors while lm-eval's header said 2.9
                       ({"actors": 2.9}, "--model_args: actors must be auto or an integer, got 2.9"),
                       ({"max_model_len": "400.7"}, "--model_args: max_model_len must be auto or an integer, got '400.7'"),
                       ({"backend": "tpu"}, "--model_args: backend: must be one of"),
                       ({"dtype": "float32"}, "--model_args: dtype is not one raysweep takes"),
                       ({"max_length": "50"}, "--model_args: max_length is not one raysweep takes")]:
        with pytest.raises(RaysweepError) as refused:
            RaysweepLM(pretrained="builtin:tiny", **args)
        assert str(refused.value).startswith(says), (args, str(refused.value))


def _lm_eval_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", *args], cwd=ROOT,
                          env=env or _env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_lm_eval_command_line_errors_are_one_line_with_advice_it_can_follow(include_path, tmp_path, ray_local):
    """`--tasks ht_nope` ended in lm-eval's ValueError traceback (now one line, with the closest names lm-eval
    knows); another spec's output advised `--new-run`, which `raysweep lm-eval` does not have."""
    proc = _lm_eval_cli("--model_args", "pretrained=builtin:tiny", "--tasks", "rs_mcq,ht_nope", "--include_path",
                        str(include_path))
    last = proc.stderr.splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("raysweep: error: lm-eval: Tasks not found: rs_mcq, ht_nope; "
                                                    "closest to rs_mcq: rs_mc, rs_mc0"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    other = tmp_path / "runs" / "loglikelihood"  # another spec's results where this one's loglikelihood sweep goes
    other.mkdir(parents=True)
    (other / "manifest.json").write_text(json.dumps({"sweep": "x", "spec_hash": "0" * 16, "shards": {
        "tiny/rs_mc/00000": {"state": "committed", "file": "results/tiny/rs_mc/shard-00000.parquet", "rows": 1}}}))
    proc = _lm_eval_cli("--model_args", f"pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=1,"
                        f"output={tmp_path / 'runs'}", "--tasks", "rs_mc", "--include_path", str(include_path),
                        "--limit", "2", env=_env(ray_local))
    said = [line for line in proc.stderr.splitlines() if line.startswith("raysweep: error:")]
    assert len(said) == 1, proc.stderr[-2000:]
    last = said[0]
    assert proc.returncode == 2 and last.startswith(f"raysweep: error: output {other} holds results of another spec"), \
        proc.stderr[-2000:]
    assert last.endswith(f"use another output= in --model_args, or remove the folder {tmp_path / 'runs'} to discard "
                         "them")  # the output= folder: every request type's results
    assert "--new-run" not in proc.stderr and "Traceback" not in proc.stderr
    # a generation length the model's length cannot hold: said in the command's own terms (it named a `<spec>` and
    # `tasks.rs_gen.sampling.max_tokens`, neither of which this command has)
    proc = _lm_eval_cli("--model_args", "pretrained=builtin:tiny,max_model_len=12,actors=1", "--tasks", "rs_gen",
                        "--include_path", str(include_path), "--limit", "2", env=_env(ray_local))
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        "raysweep: error: --model_args: lm-eval task rs_gen: its max_gen_toks 12 leaves no room for a prompt in "
        "model tiny's max_model_len 12; lower max_gen_toks (gen_kwargs) or raise max_model_len"), proc.stderr[-2000:]


@pytest.mark.slow
def test_lm_eval_without_output_removes_its_temporary_folder(include_path, tmp_path, ray_local):
    """Each `raysweep lm-eval` without output= left a /tmp/raysweep-lm-eval-* folder behind."""
    tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's sockets go under TMPDIR too
    try:
        proc = _lm_eval_cli("--model_args", f"pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=1",
                            "--tasks", "rs_mc", "--include_path", str(include_path), "--limit", "2",
                            env={**_env(ray_local), "TMPDIR": str(tmp), "RAYSWEEP_ENGINE_HOST": "0"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "rs_mc" in proc.stdout and "planned tiny/rs_mc: 2 samples" in proc.stderr
        assert not list(tmp.glob("raysweep-lm-eval-*"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_lm_evals_command_line_indexes_only_the_include_path_that_holds_every_task(include_path, monkeypatch):
    """`raysweep lm-eval ... --tasks a,b --include_path DIR`: lm-eval's TaskManager reads DIR alone where it holds
    a and b (not lm-eval's own 14,000 task files); else DIR and lm-eval's tasks, as lm-eval does."""
    import lm_eval.tasks

    from cluster.lm_eval.adapter import own_tasks_indexed
    from jobs.lm_eval_command import task_names

    assert task_names(["--model", "raysweep", "--tasks", "rs_mc,rs_gen", "rs_ppl", "--num_fewshot", "2"]) == \
        ["rs_mc", "rs_gen", "rs_ppl"]
    assert task_names(["--tasks=rs_mc, rs_gen", "-t", "x"]) == ["rs_mc", "rs_gen", "x"]
    original = lm_eval.tasks.TaskManager
    with own_tasks_indexed(["rs_mc", "rs_gen"]):
        manager = lm_eval.tasks.TaskManager(include_path=str(include_path), metadata={})
    assert lm_eval.tasks.TaskManager is original and isinstance(manager, original)
    assert set(manager.all_tasks) == {"rs_mc", "rs_mc0", "rs_gen", "rs_ppl"}
    assert manager.load(["rs_mc"])["tasks"]

    made = []  # where a name is not in the folder: indexed again with lm-eval's tasks (recorded, not read: 14 s)

    def recorded(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
        made.append(include_defaults)
        self.recorded_tasks = ["rs_mc"] + (["arc_easy"] if include_defaults else [])

    monkeypatch.setattr(original, "__init__", recorded)  # lm-eval's own TaskManager's, under raysweep's
    monkeypatch.setattr(original, "all_tasks", property(lambda self: self.recorded_tasks))
    with own_tasks_indexed(["rs_mc", "arc_easy"]):
        assert "arc_easy" in lm_eval.tasks.TaskManager(include_path=str(include_path)).all_tasks
    assert made == [False, True]
    made.clear()
    with own_tasks_indexed(["rs_mc"]):
        lm_eval.tasks.TaskManager()  # no include_path: lm-eval's tasks, once
        lm_eval.tasks.TaskManager(include_path=str(include_path), include_defaults=False)
    assert made == [True, False]


def test_building_requests_skips_what_only_lm_evals_results_record(include_path, tmp_path, monkeypatch):
    """The building pass throws its results away: it neither seeds torch (importing it) nor collects the
    environment (torch's collect_env runs nvidia-smi, pip ...) nor runs `git describe`: 10.1-10.4 s to check
    a spec of 2 tasks x 1,200 documents on 2 CPU cores before, 5.6-5.8 s after. The scoring pass keeps them."""
    import lm_eval.evaluator as evaluator

    from cluster.lm_eval.adapter import without_run_record

    def refused(*args):
        raise AssertionError("called while building requests")

    for name in ("add_env_info", "get_git_commit_hash", "set_torch_seed"):
        monkeypatch.setattr(evaluator, name, refused)
    spec = _load(write_spec(tmp_path, {"tasks": ["rs_mc", "rs_gen"], "include_path": str(include_path),
                                       "num_fewshot": 2}))
    assert {t.name for t in spec.tasks} == {"rs_mc", "rs_gen"}
    assert evaluator.add_env_info is refused and evaluator.get_git_commit_hash is refused  # lm-eval's own back
    with without_run_record():
        assert evaluator.add_env_info({}) is None and evaluator.get_git_commit_hash() is None
    assert evaluator.add_env_info is refused


def test_the_scoring_pass_takes_lm_evals_environment_record_while_it_scores(monkeypatch):
    """lm-eval's environment record (torch's collect_env: pip list, nvidia-smi, CUDA's start) is taken on a thread
    from the scoring pass's start, by lm-eval's own function, and lands in the results where lm-eval puts it; a
    record that failed on the thread is taken again in place. lm-eval's function is back after the pass. torch is
    imported whole before that thread starts, also in a pass that no sweep's shards preceded (a complete resume):
    two threads importing torch at once left it half initialised for one."""
    import threading

    import lm_eval.evaluator as evaluator

    import cluster.lm_eval.run as run
    from cluster.contracts.lm_eval_task import LmEvalSettings
    from cluster.lm_eval.run import run_lm_eval

    taken, started = [], threading.Event()
    monkeypatch.setattr(run, "_AHEAD", {"thread": None})  # no sweep's shards ran before this pass

    def add_env_info(storage: dict) -> None:  # lm-eval's, as slow as its subprocesses make it
        assert run._AHEAD["thread"] is not None and not run._AHEAD["thread"].is_alive()  # torch's import done
        taken.append(threading.current_thread().name)
        started.set()
        storage.update(pretty_env_info="torch ...", lm_eval_version="0.4.13")

    def simple_evaluate(**kw) -> dict:
        assert started.wait(30)  # begun before lm-eval made its results
        results = {"results": {}}
        evaluator.add_env_info(results)  # where evaluator.py adds it
        return results

    monkeypatch.setattr(evaluator, "add_env_info", add_env_info)
    monkeypatch.setattr(evaluator, "simple_evaluate", simple_evaluate)
    settings = LmEvalSettings(tasks=("rs_mc",))
    results = run_lm_eval(settings, None, None, log_samples=False, bootstrap_iters=0)
    assert results["pretty_env_info"] == "torch ..." and results["lm_eval_version"] == "0.4.13"
    assert taken == ["raysweep-run-record"] and evaluator.add_env_info is add_env_info

    def fails_on_the_thread(storage: dict) -> None:
        if threading.current_thread().name == "raysweep-run-record":
            started.set()
            raise RuntimeError("no nvidia-smi")
        storage.update(pretty_env_info="in place")

    monkeypatch.setattr(evaluator, "add_env_info", fails_on_the_thread)
    assert run_lm_eval(settings, None, None, log_samples=False, bootstrap_iters=0)["pretty_env_info"] == "in place"


def test_lm_evals_request_cache_is_used_only_in_a_folder_a_run_holds_and_its_own_path_comes_back(tmp_path,
                                                                                                   monkeypatch):
    """The building and scoring passes ask lm-eval for its request cache only where a run holds it in a folder of
    its own (jobs/lifecycle.py): lm-eval's own folder is shared by every process, and its key names neither a limit
    nor the data. A limit turns it off there too. lm-eval's path is back when the run lets it go."""
    import lm_eval.caching.cache as cache
    import lm_eval.evaluator as evaluator

    from cluster.contracts.lm_eval_task import LmEvalSettings
    from cluster.lm_eval.adapter import own_request_cache
    from cluster.lm_eval.run import run_lm_eval

    asked = []
    monkeypatch.setattr(evaluator, "simple_evaluate", lambda **kw: asked.append((kw["cache_requests"], cache.PATH)))
    lm_evals_own = cache.PATH
    run_lm_eval(LmEvalSettings(tasks=("rs_mc",)), None, None, log_samples=False, bootstrap_iters=0,
                requests_only=True)
    with own_request_cache(str(tmp_path)):
        for settings in (LmEvalSettings(tasks=("rs_mc",)), LmEvalSettings(tasks=("rs_mc",), limit=3)):
            run_lm_eval(settings, None, None, log_samples=False, bootstrap_iters=0, requests_only=True)
    assert asked == [(False, lm_evals_own), (True, str(tmp_path)), (False, str(tmp_path))]
    assert cache.PATH == lm_evals_own


def test_transformers_is_imported_whole_before_the_environment_records_thread_starts():
    """lm-eval's environment record names transformers' version, and its thread may be the first to import it.
    transformers swaps its module for a lazy one at the end of its import, and the scoring pass's thread, hashing
    a dataset's config meanwhile (`datasets` looks for `transformers.PreTrainedTokenizerBase`), was handed the
    module being swapped: "module 'transformers' has no attribute 'PreTrainedTokenizerBase'", a traceback instead
    of the summary, in 6 of 16 scoring passes of a complete output on the 2-core machine without this import
    (0 of 16 with it). In a fresh process with no transformers imported (a driver that loaded no tokenizer),
    entering the pass's record leaves transformers whole on the caller's thread before the record's thread runs."""
    probe = textwrap.dedent("""
        import json, sys, threading
        import lm_eval.evaluator as evaluator
        from cluster.lm_eval.adapter import run_record_ahead
        before = "transformers" in sys.modules
        gate = threading.Event()
        evaluator.add_env_info = lambda storage: gate.wait(60)  # the record's thread holds still: no import there
        with run_record_ahead():
            module = sys.modules.get("transformers")
            whole = module is not None and not module.__spec__._initializing
            found = whole and module.PreTrainedTokenizerBase.__name__
            gate.set()
        print(json.dumps({"before": before, "whole": whole, "found": found}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"before": False, "whole": True, "found": "PreTrainedTokenizerBase"}


def test_the_scoring_pass_loads_the_datasets_again_without_asking_the_hub_to_count_them(monkeypatch):
    """`datasets` sends the hub a HEAD request for each load (its download count); the scoring pass loads what the
    building pass loaded, and on a machine that cannot reach the hub that request waited 5.6 s for its name lookup
    at the end of a suite's sweep (2-core CPU machine). The building pass counts the load as lm-eval's own does."""
    import datasets.config
    import datasets.load
    import lm_eval.evaluator as evaluator

    from cluster.contracts.lm_eval_task import LmEvalSettings
    from cluster.lm_eval.run import run_lm_eval

    asked = []
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    monkeypatch.setattr(datasets.load, "get_session", lambda: SimpleNamespace(head=lambda url, **kw: asked.append(url)))
    monkeypatch.setattr(evaluator, "simple_evaluate", lambda **kw: datasets.load.increase_load_count("json"))
    settings = LmEvalSettings(tasks=("rs_mc",))
    run_lm_eval(settings, None, None, log_samples=False, bootstrap_iters=0)  # the scoring pass
    assert asked == [] and datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is True  # the setting is back after it
    run_lm_eval(settings, None, None, log_samples=False, bootstrap_iters=0, requests_only=True)  # the building pass
    assert len(asked) == 1


def test_a_model_folders_files_say_whether_it_has_a_chat_template_without_loading_its_tokenizer(tmp_path, tiny_path):
    from cluster.inputs.model_files import load_tokenizer
    from cluster.lm_eval.answered import TokenizerOnUse
    from jobs.lm_eval_model import has_chat_template

    assert has_chat_template(str(tiny_path)) is True  # builtin:tiny's tokenizer config carries one
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    assert has_chat_template(str(tmp_path / "plain")) is False
    (tmp_path / "plain" / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(str(tmp_path / "plain")) is True
    assert has_chat_template("org/model-on-the-hub") is None  # not a folder: the tokenizer is loaded to know
    tokenizer = TokenizerOnUse(lambda: load_tokenizer(str(tiny_path)))
    assert tokenizer._tokenizer is None and tokenizer.chat_template and tokenizer._tokenizer is not None


def test_a_tokenizer_with_named_chat_templates_renders_with_its_default_as_lm_evals_hf_model_does(tmp_path, tiny_path):
    """A tokenizer config giving several named templates (a list; transformers reads it as a dict): lm-eval's hf model
    renders with "default". raysweep's was a traceback in `raysweep lm-eval` (the dict hashed as text) and in a spec
    entry (an unhashable dict)."""
    import shutil

    from transformers import AutoTokenizer

    from cluster.inputs.model_files import chat_tokenizer
    from cluster.lm_eval.answered import AnswersFrom

    folder = tmp_path / "multi"
    shutil.copytree(tiny_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    own = config["chat_template"]
    config["chat_template"] = [{"name": "default", "template": own}, {"name": "alt", "template": "{{ messages }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(folder)

    lm = AnswersFrom(lambda kind, requests: []).templated(tokenizer)
    assert lm.chat_template(True) == own and lm.chat_template("alt") == "{{ messages }}"
    assert chat_tokenizer([types.SimpleNamespace(path=str(folder))] * 2, str(tmp_path)).chat_template["default"] == own


def test_score_ahead_imports_torch_on_one_thread_and_the_scoring_pass_waits_for_it():
    """score_ahead imports torch (which lm-eval's scoring pass seeds first) on one daemon thread per process while
    the shards run; in a fresh process, where nothing has imported torch yet."""
    probe = textwrap.dedent("""
        import sys
        from cluster.lm_eval import run as lm_eval_run
        assert "torch" not in sys.modules
        lm_eval_run.score_ahead()
        thread = lm_eval_run._AHEAD["thread"]
        lm_eval_run.score_ahead()
        assert lm_eval_run._AHEAD["thread"] is thread and thread.daemon
        thread.join(120)
        assert "torch" in sys.modules
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-2000:]


class _EveryAnswer(dict):
    """Committed rows for every request of a task: each choice equally likely (what the answers are does not matter
    here, only that scoring reaches every document)."""

    def get(self, key, default=None):
        return {"status": "ok", "choice_logprobs": [-1.0] * 4, "choice_greedy": [False] * 4, "output_text": ""}


def _score(task, answers: dict):
    """lm-eval's scoring pass of `task` (a planned TaskSpec) from `answers`, with the checks of what it read."""
    from cluster.lm_eval.quiet import quiet
    from cluster.lm_eval.run import run_lm_eval, task_manager
    from cluster.lm_eval.scores import check_documents, replay_lm

    settings = task.lm_eval.settings
    manager = task_manager(settings)
    with quiet():
        results = run_lm_eval(settings, replay_lm(answers, {task.name: task.lm_eval.requests}, manager), manager,
                              log_samples=True, bootstrap_iters=0)
    check_documents(results, [task], manager)
    return results


@pytest.mark.parametrize("change", ["labels", "template"])
def test_answers_are_never_scored_against_documents_that_changed_after_planning(tmp_path, change):
    """A task's data or template edited after the sweep planned it: scoring stops with one line naming the task
    and its YAML, rather than pair the answers with other labels or prompts (planned as they are: only the
    missing answers stop it)."""
    from cluster.lm_eval.scores import ChangedDocuments, MissingAnswer

    tasks = write_tasks(tmp_path / "own")
    spec = _load(write_spec(tmp_path, {"tasks": ["rs_mc0"], "include_path": str(tasks), "limit": 8}))
    task = next(t for t in spec.tasks if t.lm_eval is not None)
    assert _score(task, {task.name: _EveryAnswer()})["results"]["rs_mc0"]  # as planned: scored
    with pytest.raises(MissingAnswer) as no_rows:  # as planned, no answers: only the missing rows stop it
        _score(task, {})
    assert not isinstance(no_rows.value, ChangedDocuments)
    if change == "labels":  # the same questions and choices, each label moved on by one
        data = tasks.parent / "data" / "mc_test.jsonl"
        docs = [json.loads(line) for line in data.read_text().splitlines()]
        data.write_text("".join(json.dumps(dict(d, label=(d["label"] + 1) % 4)) + "\n" for d in docs))
        what = "documents"
    else:
        yaml_file = tasks / "rs_mc0.yaml"
        yaml_file.write_text(yaml_file.read_text().replace('doc_to_text: "Question:', 'doc_to_text: "EDITED Question:'))
        what = "prompts"
    with pytest.raises(ChangedDocuments, match=rf"task rs_mc0: its {what} changed since the sweep planned them "
                                               rf"\(.*rs_mc0.yaml\)"):
        _score(task, {task.name: _EveryAnswer()})


def test_a_resume_after_a_tasks_documents_changed_is_refused_naming_them(tmp_path):
    from cluster.inputs.data import data_hashes
    from cluster.store.manifest import _check_data
    from cluster.store.output_files import SinkError

    tasks = write_tasks(tmp_path / "own")
    # a limit: no request cache, which a later process would not share either (cluster/lm_eval/run.py)
    entry = {"tasks": ["rs_mc0"], "include_path": str(tasks), "limit": 8}
    before = data_hashes(_load(write_spec(tmp_path, entry)))
    assert before["rs_mc0"]["documents"]
    manifest = {"data": before, "shards": {"tiny/rs_mc0/00000": {"state": "committed", "file": "f", "rows": 1}}}
    data = tasks.parent / "data" / "mc_test.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps(dict(d, label=(d["label"] + 1) % 4)) + "\n" for d in docs))
    after = data_hashes(_load(write_spec(tmp_path, entry)))
    assert after["rs_mc0"]["hash"] == before["rs_mc0"]["hash"]  # the rows (prompts, choices) are the same
    with pytest.raises(SinkError, match="the documents of lm-eval task rs_mc0 .* changed"):
        _check_data("out", manifest, after)


@pytest.mark.slow
def test_a_run_resumed_after_a_label_changed_is_refused_in_one_line(tmp_path, ray_local):
    """End to end through `raysweep run`: the manifest records each lm-eval task's documents, so a second run
    after a label was edited is refused in one line (it re-scored the old answers against the new label, exit 0,
    before); with --new-run it runs again."""
    tasks = write_tasks(tmp_path / "lm")
    spec = write_spec(tmp_path, {"tasks": ["rs_mc0"], "include_path": str(tasks), "limit": 6})
    first = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["data"]["rs_mc0"]["documents"]
    data = tasks.parent / "data" / "mc_test.jsonl"
    docs = [json.loads(line) for line in data.read_text().splitlines()]
    data.write_text("".join(json.dumps(dict(d, label=(d["label"] + 1) % 4)) + "\n" for d in docs))
    again = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                           capture_output=True, text=True, timeout=600)
    said = again.stdout + again.stderr
    assert again.returncode == 2 and "the documents of lm-eval task rs_mc0" in said and "Traceback" not in said, said
    assert len(list((tmp_path / "out" / "lm_eval" / "tiny").glob("results_*.json"))) == 1


def test_scorings_own_lines_reach_the_terminal_though_lm_eval_is_kept_quiet(tmp_path, monkeypatch, capsys):
    """What scoring says about a model (`not written: ...`) is printed after lm-eval's quiet(), which sends the
    scoring thread's prints to lm-eval's logger: the line was lost there. A stop signal's line is written to
    `terminal_stderr()`, the process's own stderr also while quiet() points fd 2 at /dev/null."""
    import os

    import cluster.lm_eval.scores as scores
    from cluster.lm_eval.quiet import quiet, terminal_stderr

    tasks = write_tasks(tmp_path / "own")
    spec = _load(write_spec(tmp_path, {"tasks": ["rs_mc0"], "include_path": str(tasks), "limit": 4}))

    def changed(*args, **kwargs):
        raise scores.ChangedDocuments("task rs_mc0: its documents changed since the sweep planned them")

    monkeypatch.setattr(scores, "scored_leaving_out_failures", changed)
    import pyarrow as pa

    rows = pa.table({c: pa.array([], pa.string()) for c in scores.ANSWER_COLUMNS})
    metrics = scores.score_lm_eval(spec, lambda model, task: rows, lambda *a: None, lambda *a: None, print)
    # the task's summary row carries why, so the run exits 1 (it exited 0 with the score left empty)
    assert metrics == {("tiny", "rs_mc0"): {"error": "lm-eval results not written: task rs_mc0: its documents changed "
                                                     "since the sweep planned them"}}
    assert "[raysweep] lm-eval results of model tiny not written: task rs_mc0: its documents changed" in capsys.readouterr().out
    assert terminal_stderr() == 2
    with quiet():
        assert terminal_stderr() != 2 and os.fstat(terminal_stderr()).st_ino != os.fstat(2).st_ino
    assert terminal_stderr() == 2


def test_a_signal_outside_a_run_while_lm_eval_is_quiet_is_one_line_on_the_terminal():
    """`raysweep plan` of a spec with `lm_eval:` entries, stopped while lm-eval loads its tasks (its stderr is
    /dev/null then): the command's one line was written there, so Ctrl-C printed nothing."""
    program = ("import os, signal, time, jobs\n"
               "from cluster.lm_eval.quiet import quiet\n"
               "signal.signal(signal.SIGINT, jobs._stopped_at_once)  # as a command's process installs it\n"
               "with quiet():\n"
               "    os.kill(os.getpid(), signal.SIGINT)\n"
               "    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert done.stderr == "[raysweep] stopped by SIGINT: no sweep was running, none was cut short\n"


def test_generation_arguments_are_read_as_lm_evals_models_read_them():
    """lm-eval's aliases of max_gen_toks (max_new_tokens, max_tokens, max_completion_tokens, in lm-eval's order of
    priority) and num_beams: 1 are taken; beam search, which vLLM's sampling does not run, is refused naming the task."""
    from cluster.lm_eval.requests import sampling_of

    def sampling(gen: dict):
        return sampling_of("t", [SimpleNamespace(args=("Q:", gen), repeats=1)])

    assert sampling({"until": ["\n"], "max_new_tokens": 7}).max_tokens == 7
    assert sampling({"max_completion_tokens": 5}).max_tokens == 5
    assert sampling({"max_tokens": 5, "max_new_tokens": 6, "max_gen_toks": 9}).max_tokens == 9
    assert sampling({"until": "\n\n", "num_beams": 1, "do_sample": False}).stop == ("\n\n",)
    assert sampling({}).max_tokens == 256 and sampling({}).temperature == 0.0
    assert sampling({"do_sample": True}).temperature == 1.0 and sampling({"temperature": 0.5}).temperature == 0.5
    with pytest.raises(ValueError, match="t: generation argument num_beams: 4: beam search"):
        sampling({"num_beams": 4})
    with pytest.raises(ValueError, match="t: generation argument 'typical_p' is not one raysweep passes"):
        sampling({"typical_p": 0.9})
    assert sampling({"temperature": "0.5", "top_k": "3"}).top_k == 3  # --gen_kwargs' text
    for key, value in (("max_gen_toks", [1]), ("top_p", [1]), ("top_k", {"a": 1}), ("temperature", "abc"),
                       ("max_new_tokens", True)):  # was a TypeError traceback, or a message naming no argument
        with pytest.raises(ValueError, match=f"t: generation argument {key}: must be a number, got "):
            sampling({key: value})
    with pytest.raises(ValueError, match="t: generation arguments: max_tokens: must be"):
        sampling({"max_gen_toks": 0})


def test_what_lm_eval_prints_while_it_scores_goes_to_its_logger_and_other_threads_print_on(capfd, monkeypatch):
    """lm-eval prints `bootstrapping for stddev: perplexity` while it scores (a task with the perplexity metric):
    the line landed among the run's own, by its summary table. Inside quiet() what its thread prints goes to
    lm-eval's logger; a line printed from another thread meanwhile (the Ray start, while lm-eval builds requests)
    still reaches stdout."""
    import logging
    import threading

    import lm_eval.api.metrics as metrics

    from cluster.lm_eval.quiet import quiet

    logged = []
    monkeypatch.setattr(logging.getLogger("lm_eval"), "info", lambda *args: logged.append(args[0] % args[1:]))
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap in this process (it prints either way)
    with quiet():
        metrics.bootstrap_stderr(metrics.perplexity, [-1.0, -2.0, -3.0], iters=10)
        other = threading.Thread(target=print, args=("[raysweep] said on another thread",))
        other.start()
        other.join()
    print("[raysweep] after")
    out = capfd.readouterr().out
    assert out == "[raysweep] said on another thread\n[raysweep] after\n"
    assert logged == ["bootstrapping for stddev: perplexity"]


@pytest.mark.parametrize("setting, says", [
    ({"num_fewshot": 1000}, "tasks[0].lm_eval: task rs_mc: num_fewshot 1000 is more than its few-shot split 'train' "
                            "can give (8 document(s)): give num_fewshot 8 or fewer"),
    ({"samples": {"rs_mc": [0, 99]}}, "tasks[0].lm_eval.samples: task rs_mc: Elements of --samples should be in the "
                                      f"interval [0,k-1] where k is the number of total examples. In this case, "
                                      f"k={MC_DOCS}."),
])
def test_an_entrys_few_shot_or_sample_past_what_the_task_holds_is_one_line_naming_its_setting(include_path, tmp_path,
                                                                                             setting, says):
    """`num_fewshot: 1000` on an entry whose task has 8 few-shot documents was "lm-eval could not build the requests:
    ValueError: Sample larger than population or is negative"; a `samples` index past the documents was said of the
    entry's `tasks`."""
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.spec_file import load_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"name": "fs", "output": str(tmp_path / "out"),
                                "models": [{"name": "tiny", "path": "builtin:tiny",
                                            "engine": {"max_model_len": MAX_MODEL_LEN}}],
                                "tasks": [{"lm_eval": {"tasks": ["rs_mc"], "include_path": str(include_path),
                                                       **setting}}]}))
    with pytest.raises(Exception) as refused:
        check_inputs(load_spec(spec))
    assert str(refused.value) == f"{spec}: {says}"
