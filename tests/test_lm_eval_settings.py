"""A `lm_eval:` entry's seed, predict_only, samples and use_cache (docs/lm-eval.md): checked when the spec is
loaded, one line each; given to lm-eval as its command line gives them, so a spec entry and `raysweep lm-eval`
with the same settings write the same records byte for byte."""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.contracts.lm_eval_task import LmEvalSettings
from cluster.contracts.spec import SpecError
from tests.conftest import ROOT

pytest.importorskip("lm_eval")

from tests.test_lm_eval_tasks import MAX_MODEL_LEN, _env, _load, write_spec, write_tasks  # noqa: E402

TASKS = ("rs_mc", "rs_gen", "rs_ppl")
SAMPLES = {"rs_mc": [1, 4, 7, 10], "rs_gen": [0, 3, 5], "rs_ppl": [0, 1, 2, 6]}  # rs_ppl's document 1 is empty


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-settings"))


def test_seed_is_taken_as_lm_evals_seed_one_integer_or_four():
    assert LmEvalSettings(tasks=("t",)).seeds == (0, 1234, 1234, 1234)  # lm-eval's defaults
    assert LmEvalSettings(tasks=("t",), fewshot_seed=5).seeds == (0, 1234, 1234, 5)
    assert LmEvalSettings(tasks=("t",), seed=42).seeds == (42, 42, 42, 42)
    assert LmEvalSettings(tasks=("t",), seed=[7, None, 8, 52]).seeds == (7, None, 8, 52)
    assert LmEvalSettings(tasks=("t",), seed=[7, None, 8, 52], fewshot_seed=52).seeds == (7, None, 8, 52)
    for seed in ([1, 2], "42", True, [1, 2, 3, 4.5]):
        with pytest.raises(ValueError, match=re.escape("seed: one integer, or four (random, numpy, torch, few-shot")):
            LmEvalSettings(tasks=("t",), seed=seed)
    with pytest.raises(ValueError, match=r"^fewshot_seed: 5, but seed's fourth value \(the few-shot seed\) is 52"):
        LmEvalSettings(tasks=("t",), seed=[7, None, 8, 52], fewshot_seed=5)


@pytest.mark.parametrize("settings, said", [
    ({"samples": {"rs_mc": [3, 1]}}, "samples.rs_mc: document indices in increasing order without repeats"),
    ({"samples": {"rs_mc": [1, 1]}}, "samples.rs_mc: document indices in increasing order without repeats"),
    ({"samples": {"rs_mc": [-1]}}, "samples.rs_mc: a list of document indices (integers >= 0), got [-1]"),
    ({"samples": {"rs_mc": 3}}, "samples.rs_mc: a list of document indices"),
    ({"samples": {}}, "samples: a mapping of lm-eval task names to document indices"),
    ({"samples": {"rs_mc": [1]}, "limit": 5}, "samples: lm-eval runs the documents of samples or of limit, not both"),
    ({"samples": {"rs_nope": [1]}}, "samples: 'rs_nope' is not one of the entry's lm-eval tasks (rs_mc)"),
    ({"samples": "missing.json"}, "samples: {folder}/missing.json is not a JSON file of document indices per task"),
    ({"predict_only": "yes"}, "predict_only: must be true or false, got 'yes'"),
    ({"use_cache": ""}, "use_cache: the path of lm-eval's sqlite cache of answers, got ''"),
    ({"seed": [1, 2]}, "seed: one integer, or four"),
])
def test_the_settings_are_refused_in_one_line_naming_them(include_path, tmp_path, settings, said):
    spec = write_spec(tmp_path, {"tasks": ["rs_mc"], "include_path": str(include_path), **settings})
    with pytest.raises(SpecError) as refused:
        _load(spec)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{spec}: tasks[0].lm_eval.{said.format(folder=tmp_path)}"), message


def test_samples_from_a_json_file_and_use_cache_from_the_specs_folder(include_path, tmp_path):
    (tmp_path / "picked.json").write_text(json.dumps({"rs_mc": [2, 5]}))
    spec = _load(write_spec(tmp_path, {"tasks": ["rs_mc"], "include_path": str(include_path), "samples": "picked.json",
                                       "use_cache": "answers/tiny"}))
    settings = spec.tasks[0].lm_eval.settings
    assert settings.samples == {"rs_mc": [2, 5]} and settings.cache_of("tiny") == str(tmp_path / "answers" / "tiny")
    assert sorted(json.loads(line)["id"] for line in Path(spec.tasks[0].data).read_text().splitlines()) == ["0", "1"]


@pytest.mark.parametrize("setup, use_cache, said", [
    (lambda t: (t / "base.yaml").write_text("x"), "base.yaml/x",
     "use_cache: {folder}/base.yaml/x: {folder}/base.yaml is not a folder, so lm-eval cannot make its cache there"),
    (lambda t: (t / "c_rank0.db").mkdir(), "c",
     "use_cache: {folder}/c_rank0.db is not a regular file, so not lm-eval's sqlite cache"),
    (lambda t: (t / "c_rank0.db").write_bytes(bytes(range(256)) * 8), "c",
     "use_cache: {folder}/c_rank0.db is not an sqlite cache lm-eval can use (file is not a database)"),
])
def test_a_use_cache_lm_eval_cannot_open_is_one_line_at_load(include_path, tmp_path, setup, use_cache, said):
    """A cache path under a file, or a cache file that is a folder or random bytes, was a traceback from
    lm-eval after every sample had run."""
    setup(tmp_path)
    spec = write_spec(tmp_path, {"tasks": ["rs_mc"], "include_path": str(include_path), "use_cache": use_cache})
    with pytest.raises(SpecError) as refused:
        _load(spec)
    assert str(refused.value) == f"{spec}: tasks[0].lm_eval.{said.format(folder=tmp_path)}"


def test_a_use_cache_lm_eval_made_or_that_is_not_there_yet_loads(include_path, tmp_path):
    import sqlite3

    sqlite3.connect(tmp_path / "made_rank0.db").execute("CREATE TABLE unnamed (key TEXT PRIMARY KEY, value BLOB)")
    for use_cache in ("made", "new/folder/c"):
        spec = write_spec(tmp_path, {"tasks": ["rs_mc"], "include_path": str(include_path), "use_cache": use_cache})
        assert _load(spec).tasks[0].lm_eval.settings.cache_of("tiny") == str(tmp_path / use_cache)
    assert not (tmp_path / "new").exists()


def test_use_cache_over_several_models_needs_each_models_own_file(include_path, tmp_path):
    path = write_spec(tmp_path, {"tasks": ["rs_mc"], "include_path": str(include_path), "use_cache": "answers"})
    raw = json.loads(path.read_text())
    raw["models"].append({"name": "other", "path": "builtin:tiny"})
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=re.escape("tasks[0].lm_eval.use_cache: lm-eval's cache holds one model's "
                                                  "answers, and the sweep has 2 models: put {model} in the path")):
        _load(path)
    raw["tasks"][0]["lm_eval"]["use_cache"] = "answers-{model}"
    path.write_text(json.dumps(raw))
    settings = _load(path).tasks[0].lm_eval.settings
    assert (settings.cache_of("tiny"), settings.cache_of("other")) == (f"{tmp_path}/answers-tiny", f"{tmp_path}/answers-other")


def test_a_spec_without_the_settings_hashes_as_before_they_existed():
    """Outputs made before these settings existed still resume: left out, they are not in the spec's hash."""
    from cluster.contracts.lm_eval_task import LmEvalTask
    from cluster.contracts.spec import ModelSpec, SweepSpec
    from cluster.contracts.task_spec import TaskSpec

    def spec(**settings) -> SweepSpec:
        task = TaskSpec(name="rs_mc", data="rows.jsonl", prompt="{context}", id_column="id", type="loglikelihood",
                        choices="choices", target="target", target_delimiter="", length_policy="truncate_left",
                        lm_eval=LmEvalTask(task="rs_mc", output_type="multiple_choice",
                                           settings=LmEvalSettings(tasks=("rs_mc",), num_fewshot=2, **settings)))
        return SweepSpec(name="s", output="out", models=(ModelSpec("tiny", "builtin:tiny"),), tasks=(task,))

    assert spec().digest() == "fb85053414364071"  # this spec's hash by the raysweep before them
    assert len({spec().digest(), spec(seed=1).digest(), spec(predict_only=True).digest(),
                spec(samples={"rs_mc": [0]}).digest(), spec(use_cache="c").digest()}) == 5


def _request(doc: int, idx: int, choice: str):
    return SimpleNamespace(task_name="t", doc_id=doc, idx=idx, request_type="loglikelihood", args=("Q:", choice))


def test_use_cache_answers_what_it_holds_and_keeps_what_the_rows_answer(tmp_path):
    """lm-eval's answers cache in front of the committed rows: a request it holds (here one choice of a document,
    the others not) is answered from it, the rest from the row at their own positions, and the cache then holds
    every answer, as lm-eval's CachingLM keeps them."""
    from lm_eval.api.model import hash_args
    from sqlitedict import SqliteDict

    from cluster.lm_eval.scores import cache_file, replay_lm

    requests = [_request(0, i, c) for i, c in enumerate([" a", " b", " c"])] + [_request(1, 0, " d")]
    answers = {"t": {("0", 0): {"status": "ok", "choice_logprobs": [-1.0, -2.0, -3.0], "choice_greedy": [1, 0, 0]},
                     ("1", 0): {"status": "ok", "choice_logprobs": [-4.0], "choice_greedy": [0]}}}
    with SqliteDict(cache_file(str(tmp_path / "answers")), autocommit=True) as db:
        db[hash_args("loglikelihood", (" Q:", " b"))] = (-9.0, True)  # another request: not this one's
        db[hash_args("loglikelihood", ("Q:", " b"))] = (-20.0, True)
    got = replay_lm(answers, cache=str(tmp_path / "answers")).loglikelihood(requests)
    assert got == [(-1.0, True), (-20.0, True), (-3.0, False), (-4.0, False)]
    with SqliteDict(cache_file(str(tmp_path / "answers"))) as db:
        assert db[hash_args("loglikelihood", ("Q:", " c"))] == (-3.0, False) and len(db) == 5


def _run_both(include_path: Path, tmp_path: Path, predict_only: bool,
              ray) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The entry run from a spec and `raysweep lm-eval` with the same settings, both on the session's Ray (`ray`,
    tests/test_lm_eval_tasks.py _env); their lm-eval folders."""
    entry = {"tasks": list(TASKS), "include_path": str(include_path), "num_fewshot": 2, "seed": [7, None, 8, 52],
             "predict_only": predict_only, "samples": SAMPLES, "use_cache": str(tmp_path / "cache-spec")}
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(write_spec(tmp_path, entry))], cwd=ROOT,
                         env=_env(ray), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    cli = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", "--model_args",
         f"pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=1,output={tmp_path / 'runs'}",
         "--tasks", ",".join(TASKS), "--include_path", str(include_path), "--num_fewshot", "2", "--seed", "7,None,8,52",
         *(["--predict_only"] if predict_only else []), "--samples", json.dumps(SAMPLES),
         "--use_cache", str(tmp_path / "cache-cli"), "--output_path", str(tmp_path / "via-cli"), "--log_samples"],
        cwd=ROOT, env=_env(ray), capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    return tmp_path / "out" / "lm_eval" / "tiny", tmp_path / "via-cli" / "builtin__tiny", run


@pytest.mark.slow
@pytest.mark.parametrize("predict_only", [False, True])
def test_a_spec_entry_and_the_command_line_with_the_same_settings_write_the_same_records(include_path, tmp_path,
                                                                                          predict_only, ray_local):
    """seed (four values, one of them unset), samples, use_cache and predict_only in a spec's entry and on
    `raysweep lm-eval`'s command line: lm-eval's per-document records byte for byte, its results and seeds the
    same, both caches holding the same answers; under predict_only no metric, and the summary no score."""
    from sqlitedict import SqliteDict

    spec_dir, cli_dir, run = _run_both(include_path, tmp_path, predict_only, ray_local)
    ours, theirs = (json.loads(Path(glob.glob(f"{d}/results_*.json")[0]).read_text()) for d in (spec_dir, cli_dir))
    for task in TASKS:
        records = [Path(glob.glob(f"{d}/samples_{task}_*.jsonl")[0]).read_bytes() for d in (spec_dir, cli_dir)]
        assert records[0] == records[1], task
        doc_ids = sorted({json.loads(line)["doc_id"] for line in records[0].splitlines()})
        assert doc_ids == SAMPLES[task], task
        assert ours["results"][task] == theirs["results"][task] and ours["n-samples"][task] == theirs["n-samples"][task]
    seeds = ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")
    assert [ours["config"][k] for k in seeds] == [theirs["config"][k] for k in seeds] == [7, None, 8, 52]
    assert ours["config"]["use_cache"] == str(tmp_path / "cache-spec")
    assert theirs["config"]["model_args"]["pretrained"] == "builtin:tiny"  # the command line's, as lm-eval parsed it
    assert ours["config"]["model_args"] == {"pretrained": "builtin:tiny", "max_model_len": MAX_MODEL_LEN}  # the spec's
    caches = [dict(SqliteDict(f"{tmp_path / name}_rank0.db")) for name in ("cache-spec", "cache-cli")]
    assert caches[0] == caches[1] and len(caches[0]) == 4 * 4 + 3 + 4  # choices, generations, documents
    metrics = [k for k in ours["results"]["rs_mc"] if "," in k]
    import pyarrow.parquet as pq

    summary = {r["task"]: r for r in pq.read_table(tmp_path / "out" / "summary.parquet").to_pylist()}
    if predict_only:
        assert metrics == [] and all("bypass" in k for k in ours["results"]["rs_gen"] if "," in k)
        assert all(summary[t]["score"] is None and summary[t]["metrics"] == [] for t in TASKS)
    else:
        assert metrics and summary["rs_mc"]["score"] == ours["results"]["rs_mc"]["acc,none"]


def test_another_lm_eval_release_is_refused_in_one_line_before_lm_eval_is_used(monkeypatch):
    """cluster/lm_eval/adapter.py replaces lm-eval internals written against one release: any other is refused,
    naming both releases and the extra to install, before a request is built."""
    from cluster.contracts.lm_eval_task import VERSION
    from cluster.lm_eval import adapter, run

    adapter.require_version(VERSION)  # the release raysweep takes
    with pytest.raises(adapter.LmEvalVersionError) as refused:
        adapter.require_version("0.4.9")
    line = str(refused.value)
    assert "\n" not in line and "0.4.9" in line and VERSION in line and "raysweep[lm-eval]" in line
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.5.0")
    with pytest.raises(ValueError, match="lm-eval 0.5.0 is installed"):
        run.import_lm_eval()
