"""Nothing lost, nothing duplicated: kill -9 of the driver then resume, actors dying mid-shard, a poison
shard, rows that break generation, a lock on the output, and one-line errors for bad inputs."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from cluster.contracts.errors import PreflightError
from cluster.schedule.run import run_sweep
from cluster.store.manifest import read_manifest
from cluster.store.output_files import SinkError
from cluster.store.sink import ResultSink
from cluster.inputs.spec_file import load_spec
from tests.conftest import QUICKSTART, ROOT, lean_quickstart, prepare_file
from tests.test_metrics import metrics_url, scrape

N_SHARDS = 15 + 10 + 3  # the lean quickstart's 150 + 100 + 30 samples in shards of 10: time to interrupt it


def small_shard_spec(tmp_path, name="reliable", **task_changes):
    return lean_quickstart(tmp_path, name, shards={"max_samples": 10}, **task_changes)


def committed(out) -> int:
    try:
        manifest = read_manifest(str(out))
    except (FileNotFoundError, ValueError):
        return 0
    return sum(s["state"] == "committed" for s in manifest["shards"].values())


def _actors_with_commits(out, manifest_shards: dict | None = None) -> set[str]:
    """Actors that have committed shards so far, from the telemetry parts a running sweep writes (each is on
    disk before its shard's commit; with the manifest's shards, only those of shards it says are committed)."""
    found = set()
    for part in (out / "telemetry" / ".pending").glob("shards-*.parquet"):
        try:
            rows = pq.read_table(part, columns=["shard_id", "actor_id"]).to_pylist()
        except (OSError, ValueError):  # being written
            continue
        found |= {r["actor_id"] for r in rows if r["actor_id"] is not None and (
            manifest_shards is None or manifest_shards.get(r["shard_id"], {}).get("state") == "committed")}
    return found


def wait_for(condition, timeout_s=120):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def outputs(out) -> dict:
    table = pq.read_table(out / "results").to_pandas()
    keys = list(zip(table["task"].astype(str), table["sample_id"]))
    assert len(keys) == len(set(keys)), "a sample appears twice"
    return dict(zip(keys, table["output_text"]))


@pytest.fixture(scope="module")
def reference(engine_host, ray_local, tmp_path_factory):
    """The uninterrupted run of the small-shard spec."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = load_spec(small_shard_spec(tmp))
    run_sweep(spec, output=str(tmp / "out"), engine_host=engine_host, log=lambda line: None)
    return outputs(tmp / "out")


@pytest.mark.slow
def test_driver_kill9_then_rerun_completes_identically(ray_local, reference, tmp_path):
    """kill -9 of the driver and the local Ray it started, mid-run; the rerun joins the session's local Ray
    (ray_local, up for `reference`) rather than starting one of its own: what it resumes from is the output the
    killed run left, and a command's own local Ray after a kill is tests/test_signals.py's (its resumes)."""
    spec, out = small_shard_spec(tmp_path), tmp_path / "out"
    cmd = [sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(out)]
    driver = subprocess.Popen(cmd, cwd=ROOT, env=os.environ | {"RAY_ADDRESS": "local"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_for(lambda: committed(out) >= 3), "the sweep never committed a shard"
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the local Ray it started
    finally:
        driver.wait(timeout=60)
    interrupted_at = committed(out)
    assert 3 <= interrupted_at < N_SHARDS
    killed_actors = _actors_with_commits(out, read_manifest(str(out))["shards"])  # of the killed run's commits
    assert killed_actors
    joined = os.environ | {"RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    again = subprocess.run(cmd, cwd=ROOT, env=joined, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming: {interrupted_at} of {N_SHARDS} shards already committed" in again.stdout
    assert outputs(out) == reference  # every sample once, greedy and seeded outputs identical
    # every shard's telemetry survived the killed driver: the shards it committed too, not only the re-run's
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    assert set(shards["shard_id"]) == set(read_manifest(str(out))["shards"]) and len(read_manifest(str(out))["shards"]) == N_SHARDS
    # and its engine starts, each once, with the first token they measured
    starts = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    assert killed_actors <= set(starts["actor_id"]), starts[["actor_id", "start_index"]]
    assert not starts.duplicated(["actor_id", "start_index"]).any()
    assert starts[starts["actor_id"].isin(killed_actors)]["first_token_s"].notna().all()
    assert not (out / "telemetry" / ".pending").exists() or not any((out / "telemetry" / ".pending").iterdir())


@pytest.mark.parametrize("how", ["ray.kill", "os._exit"])
@pytest.mark.slow
def test_actor_death_mid_shard_is_retried(engine_host, ray_local, reference, tmp_path, how):
    import ray

    spec, out = load_spec(small_shard_spec(tmp_path, name=f"death-{how.replace('.', '')}")), tmp_path / "out"
    report = {}
    sweep = threading.Thread(target=lambda: report.update(
        r=run_sweep(spec, output=str(out), engine_host=engine_host, log=lambda line: None)))
    sweep.start()
    # an actor that has committed a shard runs its engine and holds more shards (the telemetry of each
    # committed shard is on disk as it commits); the other one may still be starting on a busy machine
    assert wait_for(lambda: committed(out) >= 2 and _actors_with_commits(out))
    handles = [ray.get_actor(f"raysweep:{spec.name}:{n}", namespace=f"raysweep-{spec.name}") for n in range(2)]
    actor = next(h for h in handles if h._actor_id.hex() in _actors_with_commits(out))
    if how == "ray.kill":
        ray.kill(actor)
    else:
        actor.exit.remote()
    sweep.join(timeout=300)
    assert not report["r"].failed
    assert outputs(out) == reference
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    died = shards[shards["error"].fillna("").str.contains("actor died")]
    assert len(died) >= 1, shards[["shard_id", "attempt", "error"]]
    retried = shards[shards["shard_id"].isin(died["shard_id"]) & shards["error"].isna()]
    assert (retried["attempt"] >= 2).all() and len(retried) == died["shard_id"].nunique()
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(manifest["shards"][sid]["attempts"] >= 2 for sid in died["shard_id"])
    # and the Ray metric the dashboard shows
    assert wait_for(lambda: sum(v for (name, _), v in scrape(metrics_url(), spec.name).items()
                                if name == "ray_raysweep_shard_attempts_failed_total") >= len(died), timeout_s=30)


def rows_spec(tmp_path, name: str, rows: list[dict], fail_on_error, max_samples: int, actors: int):
    """A one-task spec over `rows` ({"id", "text", "answer"}) on builtin:tiny, as `<name>.yaml`."""
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": f"{name}-{str(fail_on_error).lower()}", "output": str(tmp_path / "out"),
        "models": [{"name": "tiny", "path": "builtin:tiny"}],
        "tasks": [{"name": "p", "data": f"{name}.jsonl", "id_column": "id", "prompt": "{text}", "target": "answer",
                   "scorer": "numeric_match", "sampling": {"max_tokens": 4}, "fail_on_error": fail_on_error}],
        "shards": {"max_samples": max_samples}, "actors": {"count": actors, "num_cpus": 1}}))
    return tmp_path / f"{name}.yaml"


def poison_spec(tmp_path, fail_on_error):
    rows = [{"id": f"r{i}", "text": "" if i == 13 else f"Say {i}", "answer": str(i)} for i in range(40)]
    return rows_spec(tmp_path, "poison", rows, fail_on_error, max_samples=10, actors=2)


@pytest.mark.slow
def test_an_empty_prompt_under_fail_on_error_true_is_refused_before_ray_with_one_line(tmp_path):
    """No engine runs an empty prompt: planning finds it (it once failed its shard three times at run
    time while the valid rows beside it never ran). With fail_on_error true it is refused, naming the
    file and line, before any shard runs; otherwise it is an error row (next test)."""
    proc = subprocess.run([sys.executable, "-m", "jobs.sweep", str(poison_spec(tmp_path, True))], cwd=ROOT,
                          env=os.environ | {"RAY_ADDRESS": "local"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # planning runs while Ray starts, so Ray's own start-up lines may come first
    lines = [line for line in proc.stderr.splitlines() if line.startswith("raysweep:")]
    assert lines == [
        f"raysweep: error: task p: 1 prompt(s) empty after rendering (0 tokens): {tmp_path / 'poison.jsonl'}:14 "
        "sample_id=r13; set the task's fail_on_error to false (or a fraction) to record them as error rows"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "results").exists()


@pytest.mark.parametrize("fail_on_error", [False, 0.2])
@pytest.mark.slow
def test_rows_that_break_become_error_rows_when_allowed(engine_host, ray_local, tmp_path, fail_on_error):
    report = run_sweep(load_spec(poison_spec(tmp_path, fail_on_error)), engine_host=engine_host, log=lambda line: None)
    assert not report.failed
    results = pq.read_table(tmp_path / "out" / "results").to_pandas().set_index("sample_id")
    assert len(results) == 40
    assert results.loc["r13", "status"] == "error" and "prompt is empty" in results.loc["r13", "error"]
    assert results.loc["r13", "score"] != results.loc["r13", "score"]  # NaN: not scored
    assert (results.drop(index="r13")["status"] == "ok").all()
    summary = report.summary.to_pylist()[0]
    assert summary["n_error"] == 1 and summary["n_scored"] == 39


def test_two_sweeps_into_one_output_are_refused(tmp_path):
    spec = load_spec(QUICKSTART)
    with ResultSink(str(tmp_path / "out"), spec):
        with pytest.raises(SinkError, match=r"is in use by another sweep \(pid \d+ on "):
            ResultSink(str(tmp_path / "out"), spec)
    ResultSink(str(tmp_path / "out"), spec).close()  # released: usable again
    assert not (tmp_path / "out" / ".lock").exists()  # and a clean exit leaves no lock file behind


def test_new_run_also_discards_the_old_report(tmp_path):
    spec = load_spec(QUICKSTART)
    (tmp_path / "out").mkdir()  # an output folder that was there before (one a sink made and left empty is gone)
    ResultSink(str(tmp_path / "out"), spec).close()
    (tmp_path / "out" / "report.html").write_text("<html>an earlier run</html>")
    (tmp_path / "out" / "lm_eval" / "tiny").mkdir(parents=True)  # lm-eval's results and samples of an earlier run
    (tmp_path / "out" / "lm_eval" / "tiny" / "samples_rs_gen.parquet").write_bytes(b"PAR1")
    ResultSink(str(tmp_path / "out"), spec, new_run=True).close()
    assert not (tmp_path / "out" / "report.html").exists() and not (tmp_path / "out" / "lm_eval").exists()


@pytest.mark.parametrize("manifest", ['{"name": "my-extension", "version": "1.0"}', "{}", "not json"])
def test_a_manifest_json_that_is_not_raysweeps_is_refused_and_new_run_deletes_nothing(tmp_path, manifest):
    """A folder whose manifest.json is someone else's file: refused without advice to --new-run, and --new-run
    deletes nothing there either (it deleted the folder's own results/)."""
    spec = load_spec(QUICKSTART)
    (tmp_path / "out" / "results").mkdir(parents=True)
    (tmp_path / "out" / "results" / "keep.txt").write_text("precious")
    (tmp_path / "out" / "manifest.json").write_text(manifest)
    for new_run in (False, True):
        with pytest.raises(SinkError, match="not a raysweep manifest.*nothing was changed there: restore it, or choose "
                                            "another output$"):
            ResultSink(str(tmp_path / "out"), spec, new_run=new_run)
    assert (tmp_path / "out" / "results" / "keep.txt").read_text() == "precious"
    assert (tmp_path / "out" / "manifest.json").read_text() == manifest


def test_an_output_that_is_a_dangling_symlink_is_one_line_naming_its_target(tmp_path):
    """It said `not writable: ... non-directory entry exists`."""
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(SinkError, match=f"output {tmp_path / 'out'}: a symbolic link to {tmp_path / 'gone'}, which is "
                                        "not there; make that folder, or give another output$"):
        ResultSink(str(tmp_path / "out"), load_spec(QUICKSTART))


def test_a_folder_named_like_the_lock_is_one_line(tmp_path):
    """`.lock` as a folder in the output was an IsADirectoryError traceback."""
    (tmp_path / "out" / ".lock").mkdir(parents=True)
    with pytest.raises(SinkError, match=r"\.lock: cannot be opened as the lock a sweep holds while it writes there "
                                        r"\(Is a directory\); remove it if no sweep is writing there$"):
        ResultSink(str(tmp_path / "out"), load_spec(QUICKSTART))


def test_verify_of_an_output_killed_before_its_first_commit_is_one_line(tmp_path):
    """A run killed before its first shard committed leaves a manifest and no results/: verify raised pyarrow's
    FileNotFoundError. It has nothing to verify: one line, exit 2."""
    with ResultSink(str(tmp_path / "out"), load_spec(QUICKSTART)) as sink:
        sink.plan(["tiny/arithmetic/00000"])
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "verify", str(tmp_path / "out"), "--spec", QUICKSTART],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stderr == (f"raysweep: error: {tmp_path / 'out'}: no committed row with an "
                                                    "output to verify\n"), done.stderr


def _one_committed_shard(out, spec) -> None:
    """`out` as a run of `spec` leaves it with one row of tiny/arithmetic committed."""
    with ResultSink(str(out), spec) as sink:
        sink.plan(["tiny/arithmetic/00000"])
        sink.commit("tiny/arithmetic/00000", "tiny", "arithmetic", 0, pa.table({
            "model": ["tiny"], "task": ["arithmetic"], "sample_id": ["a"], "status": ["ok"], "score": [1.0],
            "structured_valid": pa.array([None], pa.bool_()), "output_tokens": pa.array([1], pa.int32())}), 1)


def test_a_resume_refused_for_another_spec_names_what_changed(tmp_path):
    """Refused with two hashes before; the line names each part that differs: a task's field, a task added or removed,
    a top-level field."""
    import dataclasses

    spec = load_spec(QUICKSTART)
    _one_committed_shard(tmp_path / "out", spec)
    first, *rest = spec.tasks
    for other, says in ((dataclasses.replace(spec, tasks=(dataclasses.replace(first, prompt="Q: {question}"), *rest)),
                         "tasks.arithmetic.prompt changed"),
                        (dataclasses.replace(spec, tasks=(first,)), "tasks.choice removed, tasks.extract removed"),
                        (dataclasses.replace(spec, name="other"), "name changed")):
        with pytest.raises(SinkError, match=f"holds results of another spec: {says} \\(hash "):
            ResultSink(str(tmp_path / "out"), other)


def test_version():
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("raysweep ")


def test_new_run_discards_another_specs_results(tmp_path):
    spec = load_spec(QUICKSTART)
    _one_committed_shard(tmp_path / "out", spec)
    other = load_spec(small_shard_spec(tmp_path))
    with pytest.raises(SinkError, match="--new-run"):
        ResultSink(str(tmp_path / "out"), other)
    with ResultSink(str(tmp_path / "out"), other, new_run=True) as sink:
        assert sink.manifest["spec_hash"] == other.digest() and not (tmp_path / "out" / "results").exists()


@pytest.mark.parametrize("change, message", [
    (lambda r: r["tasks"][2]["structured"].update(json_schema={"type": "objekt"}),
     "tasks.extract.structured.json_schema: not a valid JSON schema"),
    (lambda r: r["tasks"][1].update(structured={"regex": "([A-D]"}),
     "tasks.choice.structured.regex: does not compile"),
    (lambda r: r["models"][0].update(path="/nonexistent/model"), "model tiny: cannot load '/nonexistent/model'"),
    (lambda r: r.update(output="/proc/raysweep-out"), "output /proc/raysweep-out: not writable"),
    (lambda r: r["tasks"][0].update(data="missing.jsonl"), "missing.jsonl: no such data file"),
])
def test_bad_inputs_fail_before_ray_with_one_line(tmp_path, change, message):
    raw = yaml.safe_load(QUICKSTART.read_text())
    for task in raw["tasks"]:
        task["data"] = str(QUICKSTART.parent / task["data"]) if task["data"] != "missing.jsonl" else task["data"]
    change(raw)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises((PreflightError, SinkError, ValueError)) as err:
        prepare_file(path).sink.close()
    assert message in str(err.value) and "\n" not in str(err.value).strip()


def _own_data_spec(tmp_path, actors=None):
    """The quickstart with its data files copied beside the spec (so a test may change them)."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    for task in raw["tasks"]:
        source = QUICKSTART.parent / task["data"]
        (tmp_path / source.name).write_bytes(source.read_bytes())
        task["data"] = source.name
    raw["output"] = str(tmp_path / "out")
    if actors is not None:
        raw["actors"] = actors
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_resume_over_changed_data_is_refused_with_one_line_and_nothing_changes(tmp_path):
    """Results planned from one version of a file are never mixed with another's: the manifest keeps each
    task's data hash, and a run over changed data stops before Ray with one line naming the file."""
    import pyarrow as pa

    spec_path = _own_data_spec(tmp_path)
    prepared = prepare_file(spec_path)
    prepared.sink.plan(["tiny/arithmetic/00000", "tiny/arithmetic/00001"])
    one_row = pa.table({"sample_id": ["a0"], "model": ["tiny"], "task": ["arithmetic"], "status": ["ok"],
                        "score": [1.0], "structured_valid": pa.array([None], pa.bool_()), "output_tokens": [3]})
    prepared.sink.commit("tiny/arithmetic/00000", "tiny", "arithmetic", 0, one_row, 1)  # as a killed run left it
    prepared.sink.close()
    manifest = (tmp_path / "out" / "manifest.json").read_bytes()
    journal = (tmp_path / "out" / "manifest.journal").read_bytes()
    assert set(json.loads(manifest)["data"]) == {"arithmetic", "choice", "extract"}
    data = tmp_path / "arithmetic.jsonl"
    lines = data.read_text().splitlines()
    row = json.loads(lines[3])
    row["question"] += " (and then some more words, so the prompt sorts elsewhere)"
    lines[3] = json.dumps(row)
    data.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"raysweep: error: output {tmp_path / 'out'}: the data of task arithmetic ({data}) "
                                   "changed since the results there were made from it; restore it, or --new-run "
                                   "to discard them")
    assert "Started a local Ray" not in done.stderr + done.stdout
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest  # nothing in the output changed
    assert (tmp_path / "out" / "manifest.journal").read_bytes() == journal
    prepare_file(spec_path, new_run=True).sink.close()  # --new-run starts again from the new data


def test_changed_data_is_accepted_where_nothing_was_committed_from_it(tmp_path):
    """A run whose shards all failed (or never ran) leaves nothing made from the old data: the fixed file
    is simply used, and recorded."""
    spec_path = _own_data_spec(tmp_path)
    prepared = prepare_file(spec_path)
    prepared.sink.plan(["tiny/arithmetic/00000"])
    prepared.sink.fail("tiny/arithmetic/00000", ["the prompt is empty"])
    prepared.sink.close()
    data = tmp_path / "arithmetic.jsonl"
    data.write_text(data.read_text().replace('"question": "', '"question": "Q. ', 1))
    from cluster.inputs.data_files import content_hash

    again = prepare_file(spec_path)
    assert again.sink.manifest["data"]["arithmetic"]["hash"] == content_hash(str(data))
    again.sink.close()


def test_a_resume_on_another_placement_is_accepted(tmp_path):
    """`actors:` (count, GPU share, accelerator) says where a sweep runs, not what it computes: a sweep
    resumes with more actors."""
    prepared = prepare_file(_own_data_spec(tmp_path, actors={"count": 1, "num_gpus": 1}))
    prepared.sink.plan(["tiny/arithmetic/00000"])
    prepared.sink.close()
    prepare_file(_own_data_spec(tmp_path, actors={"count": 3, "num_gpus": 0.5})).sink.close()


def test_a_data_path_that_is_a_directory_is_one_line(tmp_path):
    spec_path = _own_data_spec(tmp_path)
    (tmp_path / "arithmetic.jsonl").unlink()
    (tmp_path / "arithmetic.jsonl").mkdir()
    with pytest.raises(ValueError) as err:
        prepare_file(spec_path).sink.close()
    assert str(err.value) == (f"{tmp_path / 'arithmetic.jsonl'}: is a directory; `data:` names one JSONL or "
                              "Parquet file")


def bisect_spec(tmp_path, fail_on_error):
    rows = [{"id": f"r{i}", "text": f"Say {i}", "answer": str(i)} for i in range(12)]
    return rows_spec(tmp_path, "bisect", rows, fail_on_error, max_samples=12, actors=1)


INJECTED = "RuntimeError: injected engine failure (RAYSWEEP_TEST_FAIL_SAMPLES)"


@pytest.mark.parametrize("fail_on_error", [True, False])
@pytest.mark.slow
def test_a_row_that_breaks_its_shard_every_time_is_an_error_row_and_the_others_run(tmp_path, fail_on_error):
    """One 12-row shard; the engine raises on any batch holding row r5 (the evaluator's failure injection).
    Its 11 other rows run and r5 is an error row with the engine's error, every sample once. Under
    fail_on_error true (the default) the shard fails every attempt, is bisected, and the sweep exits 1 naming
    the row; under false the actor already runs the rows one by one and the sweep exits 0. A resume runs
    nothing more and says the same."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobs.sweep", str(bisect_spec(tmp_path, fail_on_error))]
    # the injection: actors inherit the variable from the driver, which starts their (local) Ray
    env = os.environ | {"RAY_ADDRESS": "local", "RAYSWEEP_TEST_FAIL_SAMPLES": "r5"}
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == (1 if fail_on_error else 0), first.stdout[-3000:] + first.stderr[-3000:]
    results = pq.read_table(out / "results").to_pandas()
    assert sorted(results["sample_id"]) == sorted(f"r{i}" for i in range(12))  # every sample exactly once
    results = results.set_index("sample_id")
    assert results.loc["r5", "status"] == "error" and results.loc["r5", "error"] == INJECTED
    others = results.drop(index="r5")
    assert (others["status"] == "ok").all() and others["output_text"].notna().all() and others["error"].isna().all()
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert (summary["n"], summary["n_ok"], summary["n_error"], summary["n_scored"]) == (12, 11, 1, 11)
    entry = read_manifest(str(out))["shards"]["tiny/p/00000"]
    assert entry["state"] == "committed" and entry["rows"] == 12
    if not fail_on_error:
        assert "row_errors" not in entry and "FAILED" not in first.stdout
        return
    # bisected: two whole attempts failed alike, then parts, r5 alone the one that failed
    assert entry["row_errors"] == {"r5": INJECTED} and entry["attempts"] == 2
    failure = (f"1 of 12 rows failed, more than fail_on_error=True allows; first: sample r5: {INJECTED}. They are "
               "committed as error rows")
    assert f"[raysweep] FAILED shard tiny/p/00000: {failure}" in first.stdout
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    whole, parts = shards[shards["piece"].isna()], shards[shards["piece"].notna()]
    assert len(whole) == 2 and (whole["error"] == INJECTED).all()
    assert parts[parts["error"].isna()]["n_samples"].sum() == 11  # each other row ran once, in a part that ran
    assert (parts[parts["error"].notna()]["error"] == INJECTED).all()
    result_bytes = {p: p.read_bytes() for p in (out / "results").rglob("*.parquet")}

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing left to run: all 1 shard(s) of this sweep, 12 samples, were committed" in again.stdout
    assert f"[raysweep] FAILED shard tiny/p/00000: {failure}" in again.stdout  # the output still breaks the policy
    assert {p: p.read_bytes() for p in (out / "results").rglob("*.parquet")} == result_bytes
    assert len(pq.read_table(out / "telemetry" / "shards.parquet")) == len(shards)  # nothing ran
