"""The quickstart sweep end to end on a real local Ray (2 CPUs, 2 actors): every sample exactly once,
100% structured_valid, the summary equal to a recomputation from the results, and a re-run resumes."""

import math
import os
import re
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from cluster.schedule.run import run_sweep
from cluster.store.output_files import SinkError
from cluster.inputs.spec_file import load_spec
from tests.conftest import QUICKSTART, ROOT

README = ROOT / "README.md"
from tests.test_ray_output import RAY_LINE


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The README's command, as a user runs it in a terminal (a pty), run once for this file's tests: its spec,
    output folder, what the terminal showed, its stderr and exit status."""
    import fcntl
    import pty
    import struct
    import termios

    out = tmp_path_factory.mktemp("quickstart") / "qs"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120x40 terminal
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", str(QUICKSTART), "--output", str(out)],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"RAY_ADDRESS": "local"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stderr = proc.stderr.read()
    code = proc.wait(timeout=300)
    screen = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return load_spec(QUICKSTART), out, screen, stderr, code, _host_processes_left(proc.pid)


def _host_processes_left(driver: int, wait_s: float = 10) -> list[int]:
    """The command's engine host and the engine processes forked from it (their command line names the
    driver's pid last) still running `wait_s` after it exited: an engine process goes once it sees its actor's
    connection end."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if b"actors.engine_host" in argv and str(driver).encode() in argv[-3:] and not zombie:
                left.append(int(pid))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def expected_ids(spec):
    import json

    ids = set()
    for task in spec.tasks:
        with open(spec.data_path(task)) as f:
            ids |= {(task.name, json.loads(line)["id"]) for line in f if line.strip()}
    return ids


@pytest.mark.slow
def test_every_sample_exactly_once(quickstart):
    spec, out, _, stderr, code, _ = quickstart
    assert code == 0, stderr[-3000:]
    results = pq.read_table(out / "results").to_pandas()
    keys = list(zip(results["task"].astype(str), results["sample_id"]))
    assert len(keys) == len(set(keys)) == 350
    assert set(keys) == expected_ids(spec)
    assert (results["status"] == "ok").all()


@pytest.mark.slow
def test_structured_tasks_all_valid(quickstart):
    out = quickstart[1]
    results = pq.read_table(out / "results").to_pandas()
    structured = results[results["task"].astype(str).isin(["choice", "extract"])]
    assert len(structured) == 200 and structured["structured_valid"].all()
    assert set(results[results["task"] == "choice"]["output_text"]) <= {"A", "B", "C", "D"}


@pytest.mark.slow
def test_summary_equals_recomputation(quickstart):
    out = quickstart[1]
    results = pq.read_table(out / "results").to_pandas()
    summary = pq.read_table(out / "summary.parquet").to_pandas().set_index("task")
    for task, rows in results.groupby(results["task"].astype(str)):
        scores = rows["score"].dropna()
        mean = scores.mean()
        stderr = math.sqrt(((scores - mean) ** 2).sum() / (len(scores) - 1) / len(scores))
        assert summary.loc[task, "n"] == len(rows) == summary.loc[task, "n_scored"]
        assert summary.loc[task, "score"] == pytest.approx(mean)
        assert summary.loc[task, "stderr"] == pytest.approx(stderr)
    assert len(summary) == 3


@pytest.mark.slow
def test_telemetry_is_measured(quickstart):
    out = quickstart[1]
    shards = pq.read_table(out / "telemetry" / "shards.parquet").to_pandas()
    # 7 shards; those cut at the model's tail (two actors) have a row per part
    assert shards["shard_id"].nunique() == 7 and (shards["wall_s"] > 0).all() and (shards["output_tokens"] > 0).all()
    assert (shards.groupby("shard_id")["n_samples"].sum() == 50).all()
    assert shards["gpu_mem_used_max_mib"].isna().all()  # no GPU here: null, never zero
    actors = pq.read_table(out / "telemetry" / "actors.parquet").to_pandas()
    assert len(actors) == 2 and (actors["load_s"] > 0).all() and set(actors["engine"]) == {"hf"}
    # a local run: the engines ran in processes forked from the run's engine host (actors/engine_host.py), and
    # neither the host nor those processes outlived the command (the actors let go of them, not vLLM-style closes)
    assert set(actors["engine_process"]) == {"host"}
    assert quickstart[5] == []
    results = pq.read_table(out / "results").to_pandas()
    assert (results["latency_s"] >= results["ttft_s"]).all() and (results["ttft_s"] > 0).all()


@pytest.mark.slow
def test_rerun_skips_committed_shards_and_changed_spec_is_refused(engine_host, quickstart, ray_local, tmp_path):
    spec, out = quickstart[:2]
    first = pq.read_table(out / "summary.parquet")
    again = run_sweep(spec, output=str(out), engine_host=engine_host, log=lambda line: None)
    assert again.shards_run == 0 and again.shards_skipped == 7
    for a, b in zip(again.summary.to_pylist(), first.to_pylist(), strict=True):  # read back from disk
        assert a == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in b.items()}
    assert pq.read_table(out / "results").num_rows == 350
    changed = load_spec(QUICKSTART)
    object.__setattr__(changed, "name", "other")
    with pytest.raises(SinkError, match="holds results of another spec"):
        run_sweep(changed, output=str(out), engine_host=engine_host, log=lambda line: None)


def output_files(folder) -> dict:
    """Every file under an output, by its path there, with its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_rerun_into_a_complete_output_starts_no_ray_and_leaves_the_output_as_it_was(quickstart):
    """The README's command again into its complete output: every shard found committed before Ray, an actor or an
    engine is started; one line says so, the summary is the one written, and no file of the output is touched."""
    spec, out = quickstart[:2]
    before = output_files(out)
    again = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(QUICKSTART), "--output", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env=os.environ | {"RAY_ADDRESS": "local"}, timeout=300)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-3000:]
    assert ("[raysweep] nothing left to run: all 7 shard(s) of this sweep, 350 samples, were committed by an earlier "
            "run\n") in again.stdout, said[-3000:]
    assert "(0 shards run, 7 already committed)" in again.stdout and "| tiny | choice | 100 | 0.240 |" in again.stdout
    for started in ("starting a local Ray", "Ray is up", "planned ", "engine up"):
        assert started not in said, said[-3000:]
    assert output_files(out) == before


def test_cli_run_exits_on_bad_spec_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: []\ntasks: []\n")
    proc = subprocess.run([sys.executable, "-m", "jobs.sweep", str(bad)], cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | {"RAY_ADDRESS": "local"}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"raysweep: error: {bad}: models: at least one model is required (only a sweep "
                                   "of replay tasks needs none)")


@pytest.mark.slow
def test_cli_runs_the_quickstart(quickstart):
    """The README's command in a terminal: a progress bar with samples/s and ETA, a fresh local Ray, results
    where --output says."""
    _, out, screen, stderr, code, _ = quickstart
    assert code == 0, stderr[-3000:]
    bars = [part for line in screen.split("\n") for part in line.split("\r") if part.startswith("[raysweep] ")
            and "|" in part and "samples [" in part]
    assert bars and "350/350 samples" in bars[-1] and "100%" in bars[-1], screen[-3000:]
    assert re.search(r"\d+:\d+<\d+:\d+, +[\d.]+ samples/s, last: tiny/\w+/\d+\]", bars[-1]), bars[-1]  # elapsed<ETA, rate
    assert f"[raysweep] results: {out}" in screen
    # what happens before the first result is said too: Ray, planning, engines
    for said in ("[raysweep] starting a local Ray\n", "[raysweep] Ray is up (", "[raysweep] planned tiny/arithmetic: "
                 "150 samples in 3 shard(s)", "[raysweep] engine up: model tiny (hf) on actor "):
        assert said in screen, (said, screen[:3000])
    assert "| tiny | extract | 100 |" in screen and "100.0%" in screen
    assert "GPU telemetry: NVML absent on every actor; GPU columns are null, not zero" in screen
    assert pq.read_table(out / "results").num_rows == 350
    # the README's sample is this run's shape, line for line (figures, actor ids and the output's path aside),
    # and shows no machine's path
    lines = {part.rstrip() for line in screen.split("\n") for part in line.split("\r") if part.strip()}
    sample = README.read_text().split("```\n[raysweep] inputs checked")[1].split("```")[0]
    for said in filter(None, ("[raysweep] inputs checked" + sample).split("\n")):
        assert not re.search(r"(^|\s)/\w", said), said
        shape = re.sub(r"\d+", r"\\d+", re.escape(re.sub(r"actor [0-9a-f]{8}", "actor ID", said)))
        shape = re.sub(r"\\ results/quickstart$", r" .+", shape).replace(r"actor\ ID", r"actor\ [0-9a-f]{8}")
        shape = re.sub("█+", "█+", shape)  # the bar's width follows the terminal's
        shape = shape.replace(r",\ ", r",\ +")  # tqdm pads a rate under 10 samples/s (" 3.66"), as a busy machine gives
        assert any(re.fullmatch(shape, line) for line in lines), (said, screen[-3000:])
    # Ray's own log lines (its token-auth warning, "Started a local Ray instance") and what the actors print
    # (transformers' warnings, under Ray's "(EvalActor pid=...)") stay out without --verbose (jobs/ray_output.py;
    # tests/test_reproducible.py runs verify with --verbose)
    for said in (screen, stderr):
        assert not RAY_LINE.search(said), said[-3000:]


def test_a_relative_output_in_a_jobs_temporary_working_dir_goes_somewhere_that_lasts(tmp_path, monkeypatch, capsys):
    from jobs.sweep import lasting_output

    job_dir = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    job_dir.mkdir(parents=True)
    monkeypatch.setenv("RAYSWEEP_RESULTS", str(tmp_path / "kept"))
    assert lasting_output("results/quickstart", cwd=str(job_dir)) == str(tmp_path / "kept" / "results/quickstart")
    assert "goes to " + str(tmp_path / "kept" / "results/quickstart") in capsys.readouterr().out
    # anywhere else, and for absolute paths and URIs, the output is what was given
    assert lasting_output("results/quickstart", cwd=str(tmp_path)) == "results/quickstart"
    assert lasting_output(str(tmp_path / "abs"), cwd=str(job_dir)) == str(tmp_path / "abs")
    assert lasting_output("s3://bucket/out", cwd=str(job_dir)) == "s3://bucket/out"
    # the spec's own `output: ../results/quickstart`, resolved from its folder (sweeps/) inside the copy
    spec_output = load_spec(QUICKSTART).output_path().replace(str(ROOT), str(job_dir))
    assert lasting_output(spec_output, cwd=str(job_dir)) == str(tmp_path / "kept" / "results/quickstart")
    assert "the relative output results/quickstart goes to " in capsys.readouterr().out


@pytest.mark.parametrize("raised", [Exception("The current node timed out during startup. This could happen because "
                                              "some of the raylet failed to startup or the GCS has become overloaded."),
                                    ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379")])
def test_a_ray_that_does_not_start_is_one_line_naming_it(monkeypatch, raised):
    """ray.init's failures, a bare Exception among them (a raylet that did not register within Ray's own 30 s,
    seen in the suite with the machine's load at 8), end the run in one line (RayStartError), not a traceback."""
    import ray

    from jobs.ray_start import RayStartError, start_ray

    def refuse(**kwargs):
        raise raised

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(RayStartError) as err:
        start_ray("local", "RAY_ADDRESS", dashboard=False)
    assert str(err.value) == f"a local Ray did not start: {str(raised).splitlines()[0]}"
