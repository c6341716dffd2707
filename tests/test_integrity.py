"""Files you can trust: a committed results file that is swapped, shortened, missing or garbage is named by
the resume and by `raysweep verify` (one line each, before any work), never resumed over (unchecked, a file
copied over another would resume as "4 of 4 committed", exit 0, with 10 ids twice and 10 missing)."""

import html
import json
import os
import re
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from cluster.inputs.spec_file import load_spec
from cluster.schedule.run import run_sweep
from cluster.store.manifest import SUMMARIZED, read_manifest
from cluster.store.output_files import SinkError
from tests.conftest import ROOT, replay_spec


def _replay_output(tmp_path):
    """A replay sweep (no engine) of 40 rows in 4 shards of 10, committed."""
    rows = [{"id": f"r{i:02d}", "q": str(i), "a": str(i), "out": str(i)} for i in range(40)]
    replay_spec(tmp_path, "trusted", rows, shards="{max_samples: 10}")
    spec = load_spec(tmp_path / "s.yaml")
    assert not run_sweep(spec, log=lambda line: None).failed
    files = {sid: e["file"] for sid, e in read_manifest(str(tmp_path / "out"))["shards"].items()}
    assert len(files) == 4 and all("checksum" in e for e in read_manifest(str(tmp_path / "out"))["shards"].values())
    return spec, tmp_path / "out", files


def _tiny_spec(tmp_path, name: str, n: int, max_samples: int = 50):
    """A spec of one task of `n` rows on builtin:tiny (2 tokens each), one CPU actor; output tmp_path/out."""
    rows = [{"id": f"r{i}", "q": str(i), "a": str(i)} for i in range(n)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(f"""
name: {name}
output: {tmp_path / 'out'}
models: [{{name: tiny, path: "builtin:tiny"}}]
tasks: [{{name: t, data: d.jsonl, id_column: id, prompt: "{{q}}", target: a, scorer: exact_match,
          sampling: {{max_tokens: 2}}}}]
shards: {{max_samples: {max_samples}}}
actors: {{count: 1, num_cpus: 1}}
""")
    return load_spec(tmp_path / "s.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("damage, says", [
    ("copy", "changed after it was committed (checksum)"),
    ("delete", "is missing"),
    ("garbage", "cannot be read"),
    ("fewer rows", "has 5 rows, 10 were committed"),
])
def test_a_damaged_results_file_is_named_by_resume_verify_and_report(ray_local, tmp_path, damage, says):
    """A results file copied over another (`cp shard-00000.parquet shard-00001.parquet`), deleted, garbled or
    cut: the resume and verify refuse it; the report names it, leaves its rows out of every table it reads from
    results/, says so at the top of the page, and exits 1 (it exited 0 and showed the copy's rows, with a
    counts table of 40 rows beside a browser of 35); a missing one stays the report's error (exit 2)."""
    spec, out, files = _replay_output(tmp_path)
    first, second = (out / files[sid] for sid in sorted(files)[:2])
    if damage == "copy":
        shutil.copy(first, second)
    elif damage == "delete":
        os.remove(second)
    elif damage == "garbage":
        second.write_bytes(b"not parquet")
    else:
        pq.write_table(pq.read_table(second).slice(0, 5), second)
    victim = sorted(files)[1]
    with pytest.raises(SinkError, match=re.escape(f"shard {victim}: its results file {files[victim]} {says}") + ".*--new-run"):
        run_sweep(spec, log=lambda line: None)
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "verify", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"[raysweep] verify: shard {victim}: its results file {files[victim]} {says}" in proc.stdout
    assert proc.stderr.startswith("raysweep: error: 1 of 4 committed results file(s) are not what was committed")
    proc = _cli("report", str(out))
    line = f"shard {victim}: its results file {files[victim]} {says}"
    if damage == "delete":
        assert proc.returncode == 2 and proc.stderr.endswith(" is missing\n"), proc.stderr
        return
    assert proc.returncode == 1 and proc.stderr.startswith(f"raysweep: warning: output {out}: {line}"), proc.stderr
    assert proc.stderr.endswith(": left out of the report\n") and proc.stderr.count("\n") == 1, proc.stderr
    page = (out / "report.html").read_text()
    assert "not what was committed" in page and html.escape(line) in page
    from cluster.report.reading import columns_of, committed, damaged, load_manifest

    shown = columns_of(committed(out, damaged(out, load_manifest(out))[0]), ["shard_id"])["shard_id"].to_pylist()
    assert len(shown) == 30 and victim not in shown and sorted(files)[0] in shown


@pytest.mark.slow
def test_an_output_from_before_checksums_is_checked_by_its_rows_shard_ids(ray_local, tmp_path):
    spec, out, files = _replay_output(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"].values():
        entry.pop("checksum")
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "manifest.journal").unlink(missing_ok=True)
    first, second = sorted(files)[:2]
    shutil.copy(out / files[first], out / files[second])
    with pytest.raises(SinkError, match=re.escape(f"shard {second}: its results file {files[second]} holds the rows "
                                                  f"of shard(s) {first}") + r".*: restore the committed file\(s\), or "
                                            r"--new-run to discard the output's results$"):
        run_sweep(spec, log=lambda line: None)
    (out / files[second]).unlink()  # removed: missing, and the advice the same (it said "restore (or remove)")
    with pytest.raises(SinkError, match=r"is missing: restore the committed file\(s\), or --new-run"):
        run_sweep(spec, log=lambda line: None)


@pytest.mark.slow
@pytest.mark.parametrize("manifest, journal, says", [
    ("[]", None, "manifest.json: no `shards` mapping, so not a raysweep manifest"),
    (None, "5\n{}\n", "manifest.journal:1: not a shard's entry (no shard_id)"),
    (None, '{"shard_id": "api-mo', None),  # a torn last line: skipped, as a killed writer leaves it
    (None, '{"shard_id": "t/x/00009"}\n{"shard_id": "t/x/00008", "state": "committed"}\n',
     "manifest.json: shard t/x/00009: no state of committed, failed, pending"),
    (None, '{"shard_id": "t/x/00009", "state": "committed", "rows": 5}\n',  # a report's KeyError: 'file'
     "manifest.json: shard t/x/00009: committed without the path of its results file"),
])
def test_a_tampered_manifest_is_one_line_in_run_verify_and_report(ray_local, tmp_path, manifest, journal, says):
    spec, out, _ = _replay_output(tmp_path)
    if manifest is not None:
        (out / "manifest.json").write_text(manifest)
    if journal is not None:
        (out / "manifest.journal").write_text(journal)
    if says is None:
        assert not run_sweep(spec, log=lambda line: None).failed  # resumes: every shard committed already
        return
    with pytest.raises(SinkError, match=re.escape(f"output {out}: {says}")):
        run_sweep(spec, log=lambda line: None)
    for command in (["verify", str(out)], ["report", str(out)]):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", *command], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("raysweep: error: ") and says in proc.stderr, \
            (command, proc.stderr)
        assert proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_manifest_entry_naming_another_shards_file_or_no_shard_is_one_line(ray_local, tmp_path):
    """A journal line committing a shard the plan has not (its id another's, with that shard's file and checksum) was
    taken as is: the summary counted those rows twice and `verify` passed; an id that is no shard's was an IndexError.
    Each is one line now, in run and verify."""
    spec, out, files = _replay_output(tmp_path)
    first = sorted(files)[0]
    forged = first.rsplit("/", 1)[0] + "/00099"
    entry = read_manifest(str(out))["shards"][first]
    for sid, says in ((forged, f"shard {forged}: committed as {files[first]}, not its own results file "),
                      ("nonsense", "shard 'nonsense': not a shard id raysweep writes (<model>/<task>/<index>)")):
        (out / "manifest.journal").write_text("\n" + json.dumps({**entry, "shard_id": sid}) + "\n")
        with pytest.raises(SinkError, match=re.escape(f"output {out}: manifest: {says}")):
            run_sweep(spec, log=lambda line: None)
        proc = _cli("verify", str(out))
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.slow
def test_a_forged_entry_with_a_file_of_its_own_on_a_complete_output_is_refused_not_summarized(ray_local, tmp_path):
    """An output whose every shard was committed, and a journal line committing one more shard the plan lacks, with
    a copy of another shard's results as its own file and checksum: the run found nothing left to run, so it did not
    plan, and its summary counted those rows twice. The count of each plan's shards, recorded with it, differs now:
    the pair is planned again, and the entry refused."""
    spec, out, files = _replay_output(tmp_path)
    first = sorted(files)[0]
    forged, own = first.rsplit("/", 1)[0] + "/00004", files[first].replace("shard-00000", "shard-00004")
    shutil.copy(out / files[first], out / own)
    entry = read_manifest(str(out))["shards"][first]
    (out / "manifest.journal").write_text("\n" + json.dumps({**entry, "shard_id": forged, "file": own}) + "\n")
    with pytest.raises(SinkError, match=re.escape(f"output {out}: manifest: shard {forged} is not one of the 4 "
                                                  "shard(s) this spec and data plan for")):
        run_sweep(spec, log=lambda line: None)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("stray", ["copy", "rename", "notes"])
def test_a_file_the_manifest_did_not_commit_is_named_by_run_verify_and_report(ray_local, tmp_path, stray):
    """`cp shard-00000.parquet shard-00099.parquet`: run, verify and report exited 0 and every reader of
    results/ saw its 10 ids twice; a notes.txt there made verify raise ArrowInvalid."""
    spec, out, files = _replay_output(tmp_path)
    first = out / files[sorted(files)[0]]
    if stray == "copy":
        rel = str(first.relative_to(out).with_name("shard-00099.parquet"))
        shutil.copy(first, out / rel)
    elif stray == "rename":
        rel = str(first.relative_to(out).with_name("shard-00042.parquet"))
        os.rename(first, out / rel)
    else:
        rel = "results/notes.txt"
        (out / rel).write_text("my notes")
    line = f"{rel}: in results/ but committed by no shard of manifest.json"
    with pytest.raises(SinkError, match=re.escape(line) + ".*--new-run"):
        run_sweep(spec, log=lambda line: None)
    proc = _cli("verify", str(out))
    assert proc.returncode == 2 and f"[raysweep] verify: {line}" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"raysweep: error: {out}: 1 file(s) in results/ that the manifest did not "
                                  f"commit (listed above, first {rel})") and proc.stderr.count("\n") == 1, proc.stderr
    proc = _cli("report", str(out))
    warning = f"raysweep: warning: output {out}: 1 file(s) in results/ that its manifest did not commit, left out " \
              f"of the report: {rel}\n"
    if stray == "rename":  # the committed file is missing too: no report
        assert proc.returncode == 2 and proc.stderr.startswith(warning) and proc.stderr.endswith(" is missing\n")
        return
    assert proc.returncode == 1 and proc.stderr == warning  # the page is written; the exit says a file was left out
    assert f"that the manifest did not commit: {rel}" in (out / "report.html").read_text()


@pytest.mark.slow
def test_a_shards_file_renamed_into_place_but_never_recorded_is_written_again_by_the_resume(ray_local, tmp_path):
    """A run killed between the rename and the manifest's record leaves the file of a pending shard: not a
    stray to refuse, the resume's own (it runs that shard again)."""
    spec, out, files = _replay_output(tmp_path)
    manifest = read_manifest(str(out))
    sid = sorted(files)[-1]
    manifest["shards"][sid] = {"state": "pending"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "manifest.journal").unlink(missing_ok=True)
    report = run_sweep(spec, log=lambda line: None)
    assert not report.failed and report.shards_run == 1
    assert read_manifest(str(out))["shards"][sid]["state"] == "committed"


@pytest.mark.slow
@pytest.mark.parametrize("data, says", [(None, "data: not a mapping of task to data file (it is null)"),
                                        ({"t": None}, "data.t: not a data file and its hash (it is null)")])
def test_a_manifest_whose_data_entry_is_null_is_one_line_in_run_verify_and_report(ray_local, tmp_path, data, says):
    """verify raised AttributeError on `"data": null`, and so did the resume."""
    spec, out, _ = _replay_output(tmp_path)
    manifest = read_manifest(str(out))
    manifest["data"] = data
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "manifest.journal").unlink(missing_ok=True)
    with pytest.raises(SinkError, match=re.escape(f"output {out}: manifest.json: {says}")):
        run_sweep(spec, log=lambda line: None)
    for command in ("verify", "report"):
        proc = _cli(command, str(out))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
        assert proc.stderr.startswith(f"raysweep: error: output {out}: manifest.json: {says}"), (command, proc.stderr)


@pytest.mark.slow
def test_a_dead_runs_temporary_files_are_removed_and_the_summary_is_written_by_rename(ray_local, tmp_path):
    """A run killed after its last commit, before its summary: its temporary files and a summary made from fewer
    shards than are committed. The same command, with nothing left to run, removes the files and writes the summary
    again."""
    spec, out, files = _replay_output(tmp_path)
    leftovers = [out / ".manifest.0123abcd.tmp", (out / files[sorted(files)[0]]).parent / ".shard-00000.parquet.aa.tmp"]
    for path in leftovers:
        path.write_bytes(b"half")
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, SUMMARIZED: len(files) - 1}))
    inode = (out / "summary.parquet").stat().st_ino
    assert not run_sweep(spec, log=lambda line: None).failed
    assert not any(path.exists() for path in leftovers)
    assert (out / "summary.parquet").stat().st_ino != inode  # a new file renamed into place, not rewritten


def test_max_attempts_below_one_is_refused_before_anything_starts():
    proc = subprocess.run([sys.executable, "-m", "jobs.sweep", str(ROOT / "sweeps" / "quickstart.yaml"),
                           "--max-attempts", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == \
        "python -m jobs.sweep: error: argument --max-attempts: 0: must be at least 1"
    assert "Ray" not in proc.stdout


def test_a_data_file_that_lost_a_column_after_its_checks_is_the_changed_line_not_a_key_error(tmp_path, tiny_path):
    """Row 50 of the file lost the column the prompt reads between the checks and planning (the planner's thread
    stopped with a bare KeyError: 'q'): planning says the file changed while the sweep read it."""
    from transformers import AutoTokenizer

    from cluster.contracts.spec import ShardLimits
    from cluster.inputs.data import DataError, load_task
    from cluster.plan.planner import plan_task

    rows = [{"id": f"r{i}", "q": str(i), "a": str(i)} for i in range(100)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(json.dumps({
        "name": "lost", "output": str(tmp_path / "out"), "models": [{"name": "tiny", "path": "builtin:tiny"}],
        "tasks": [{"name": "t", "data": "d.jsonl", "id_column": "id", "prompt": "{q}", "target": "a"}]}))
    spec = load_spec(tmp_path / "s.yaml")
    checked = load_task(spec, spec.tasks[0])
    data.write_text("".join(json.dumps({k: v for k, v in r.items() if not (i == 50 and k == "q")}) + "\n"
                            for i, r in enumerate(rows)))
    with pytest.raises(DataError, match=re.escape(f"{data}: changed while the sweep read it")):
        plan_task(spec.models[0], checked, AutoTokenizer.from_pretrained(tiny_path), None, ShardLimits())


@pytest.mark.slow
def test_a_data_file_rewritten_while_the_sweep_plans_is_refused_and_nothing_of_it_runs(ray_local, tmp_path,
                                                                                        monkeypatch):
    """Planning read the file again without the checks: rewritten 0.3 s after "inputs checked", the sweep
    exited 0 with 102 rows for 100 ids, and the manifest kept the old file's hash."""
    import cluster.plan.plan_source as plan_source
    from cluster.inputs.data import DataError

    rows = [{"id": f"r{i}", "q": str(i), "a": str(i)} for i in range(100)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(f"""
name: rewritten
output: {tmp_path / 'out'}
models: [{{name: tiny, path: "builtin:tiny"}}]
tasks:
  - {{name: t, data: d.jsonl, id_column: id, prompt: "{{q}}", target: a, scorer: exact_match,
      sampling: {{max_tokens: 2}}}}
actors: {{count: 1, num_cpus: 1}}
""")
    real = plan_source.plan_task

    def rewritten_first(*args, **kwargs):  # the hook: the file changes between the checks and planning
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[:2] + rows))  # r0, r1 twice
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_source, "plan_task", rewritten_first)
    with pytest.raises(DataError, match=re.escape(f"{data}: changed while the sweep read it") + ".*nothing of the task ran"):
        run_sweep(load_spec(tmp_path / "s.yaml"), log=lambda line: None)
    assert not (tmp_path / "out" / "results").exists() or not list((tmp_path / "out" / "results").rglob("*.parquet"))


@pytest.mark.slow
def test_a_second_sweep_of_the_same_name_on_one_cluster_is_refused_in_one_line(ray_local, tmp_path):
    """It ended in Ray's ActorAlreadyExistsError traceback. (An actor named as the first sweep's stands in for
    it: what the check reads is the actors' names.)"""
    import ray

    from cluster.schedule.fleet_size import SweepNameTaken

    @ray.remote(num_cpus=0)
    class Running:
        pass

    holder = Running.options(name="raysweep:twin:0", namespace="raysweep-twin").remote()
    ray.get(holder.__ray_ready__.remote())
    try:
        with pytest.raises(SweepNameTaken, match="a sweep named 'twin' is running on this cluster now"):
            run_sweep(_tiny_spec(tmp_path, "twin", 4), log=lambda line: None)
    finally:
        ray.kill(holder)


@pytest.mark.slow
def test_a_torn_summary_or_telemetry_file_is_one_line_in_report_and_set_aside_by_the_next_run(engine_host, ray_local,
                                                                                             tmp_path):
    spec, out = _tiny_spec(tmp_path, "torn", 8, max_samples=4), tmp_path / "out"
    assert not run_sweep(spec, engine_host=engine_host, log=lambda line: None).failed
    (out / "summary.parquet").write_bytes(b"PAR1 torn")
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "report", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"raysweep: error: output {out}: summary.parquet cannot be read (")
    (out / "telemetry" / "shards.parquet").write_bytes(b"PAR1 torn")
    manifest = read_manifest(str(out))  # one shard made uncommitted, so the next run writes its telemetry
    sid, entry = sorted(manifest["shards"].items())[-1]
    manifest["shards"][sid] = {"state": "pending"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "manifest.journal").unlink(missing_ok=True)
    os.remove(out / entry["file"])
    lines = []
    assert not run_sweep(spec, engine_host=engine_host, log=lines.append).failed
    assert any(line.startswith("[raysweep] telemetry/shards.parquet could not be read (torn or replaced): set aside")
               for line in lines), lines
    assert list((out / "telemetry").glob("shards.parquet.unreadable-*"))
    assert pq.read_table(out / "telemetry" / "shards.parquet").num_rows == 1  # this run's shard
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "report", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_verify_with_a_spec_file_that_is_not_there_names_that_file(tmp_path, capsys):
    """`verify OUT --spec nope.yaml` said the spec OUT was made from was gone, and to pass --spec."""
    from jobs.cli import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text('{"sweep": "x", "shards": {}}')
    assert main(["verify", str(tmp_path / "out"), "--spec", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"raysweep: error: --spec {tmp_path / 'nope.yaml'}: no such spec file\n"
