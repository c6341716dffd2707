"""jobs/lm_eval_command.py: `raysweep lm-eval` stopped by Ctrl-C at any moment says one line, exits 1, and leaves
nothing behind (no process it started, no temporary folder), as `raysweep run` does (tests/test_signals.py); lm-eval's
own checks of --samples and --num_fewshot are one line each."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_lm_eval_tasks import MAX_MODEL_LEN, MC_DOCS, _env, write_tasks
from tests.test_signals import _descendants, _left_running, ctrl_c_early

pytest.importorskip("lm_eval")

FEW_SHOT_DOCS = 8  # rs_mc's few-shot split, train (tests/test_lm_eval_tasks.py write_tasks)

MOMENTS = {  # the line after which the signals are sent (None: the start), and the pause before each
    "0.1 s after the start": (None, [0.1]),
    "while its actors import": ("actor(s) importing", [0.0]),
    "twice, 0.15 s apart": ("Ray is up", [0.0, 0.15]),
}


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_of_lm_eval_is_one_line(include_path, moment):
    """Ctrl-C while the actor imported printed 82 lines of traceback; two 0.15 s apart, a traceback from
    ray.shutdown in an atexit callback; one 0.1 s after the start, Python's KeyboardInterrupt in an import."""
    marker, pauses = MOMENTS[moment]
    tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # short: Ray's socket paths go under TMPDIR too
    try:
        _stopped(include_path, tmp, marker, pauses)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stopped(include_path: Path, tmp: Path, marker: str | None, pauses: list[float]) -> None:
    command = [sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", "--model_args",
               f"pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=1", "--tasks", "rs_mc",
               "--include_path", str(include_path), "--limit", "4"]
    # TMPDIR: the command's temporary folders, counted after it
    env = _env() | {"PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), "RAY_ADDRESS": ""}
    def start() -> subprocess.Popen:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)

    lines, noted = [], {}
    if marker is None:  # 0.1 s after the start, or later where Python's own start took longer
        lm_eval, rest = ctrl_c_early(start)
    else:
        lm_eval = start()
        for line in lm_eval.stdout:
            lines.append(line)
            if marker in line:
                break
        assert marker in lines[-1], "".join(lines)[-3000:]
        for pause in pauses:
            time.sleep(pause)
            noted = noted | _descendants(lm_eval.pid)
            os.killpg(lm_eval.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        rest, _ = lm_eval.communicate(timeout=120)
    text = "".join(lines) + rest
    stopped = [line for line in text.splitlines() if line.startswith("[raysweep] stopped by SIGINT: ")]
    assert len(stopped) == 1, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    # twice: 130 where the second came during the close ("SIGINT again: stopped at once")
    assert lm_eval.returncode in ((1,) if len(pauses) == 1 else (1, 130)), text[-3000:]
    assert not _left_running(noted, within_s=15), "a process the command started outlived it"
    if len(pauses) == 1:  # closed before it ended (a second Ctrl-C ends it at once: the folders may stay)
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("raysweep-")]


def test_a_samples_index_past_the_tasks_documents_is_one_line(include_path, ray_local):
    """`--samples '{"rs_mc":[50]}'` past the task's documents was lm-eval's AssertionError traceback."""
    assert _refused(include_path, ray_local, "--tasks", "rs_mc", "--samples", '{"rs_mc": [50]}') == (
        "raysweep: error: lm-eval: --samples: task rs_mc: Elements of --samples should be in the interval [0,k-1] "
        f"where k is the number of total examples. In this case, k={MC_DOCS}.")


@pytest.mark.slow
def test_more_few_shot_examples_than_the_split_holds_is_one_line(include_path, ray_local):
    """`--num_fewshot` above the few-shot split's documents was Python's `ValueError: Sample larger than population`
    at the end of lm-eval's traceback."""
    assert _refused(include_path, ray_local, "--tasks", "rs_mc", "--num_fewshot", "1000", "--limit", "2") == (
        "raysweep: error: lm-eval: task rs_mc: num_fewshot 1000 is more than its few-shot split 'train' can give "
        f"({FEW_SHOT_DOCS} document(s)): give num_fewshot {FEW_SHOT_DOCS} or fewer")


@pytest.mark.slow
def test_a_generation_setting_raysweep_refuses_is_one_line(include_path, ray_local):
    """Beam search in the task's settings (here through --gen_kwargs; a generation argument raysweep does not
    pass, `repetition_penalty`, goes the same way: test_lm_eval_tasks.py has both messages): the right message
    after a 50-line traceback; now one line, exit 2, as a spec's entry says it."""
    said = _refused(include_path, ray_local, "--tasks", "rs_gen", "--limit", "2", "--gen_kwargs", "num_beams=2")
    assert said.startswith("raysweep: error: task rs_gen: generation argument num_beams: 2: beam search"), said


def _refused(include_path: Path, ray_local, *options: str) -> str:
    """`raysweep lm-eval` on builtin:tiny with `options`: it exits 2 with one error line and no traceback; that line."""
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", "--model_args",
                           f"pretrained=builtin:tiny,max_model_len={MAX_MODEL_LEN},actors=1", "--include_path",
                           str(include_path), *options], cwd=ROOT, env=_env(ray_local), capture_output=True,
                          text=True, timeout=300)
    said = [line for line in proc.stderr.splitlines() if line.startswith("raysweep: error:")]
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return said[0]


@pytest.mark.slow
def test_a_task_whose_dataset_cannot_be_reached_is_one_line(tmp_path):
    """A task on a hub dataset (arc_easy's, as lm-eval's own YAML names it) without network (offline here, as the
    command makes it when the hub does not answer): a 68-line traceback ending in ConnectionError after 287 s;
    now one line, exit 2, with what to do, before Ray starts."""
    (tmp_path / "rs_hub.yaml").write_text(
        "task: rs_hub\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: 0\ndoc_to_choice: '{{choices.text}}'\n")
    (tmp_path / "ok.jsonl").write_text('{"question": "Why?", "choices": ["a", "b"]}\n')
    (tmp_path / "rs_ok.yaml").write_text(  # a task that loads: the line names the one that does not
        f"task: rs_ok\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'ok.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: 0\n"
        "doc_to_choice: '{{choices}}'\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", "--model_args",
                           "pretrained=builtin:tiny,actors=1", "--include_path", str(tmp_path), "--tasks",
                           "rs_ok,rs_hub", "--limit", "2"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    said = [line for line in proc.stderr.splitlines() if line.startswith("raysweep: error:")]
    assert proc.returncode == 2 and len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith("raysweep: error: task rs_hub: lm-eval could not load the dataset (") and \
        "HF_DATASETS_OFFLINE" in said[0], said[0]
    assert "Traceback" not in proc.stderr
    # before Ray: it began once lm-eval made the model, and "lm-eval is done" came before "starting a local Ray"
    assert "Ray" not in proc.stderr.replace("raysweep", ""), proc.stderr[-3000:]
    print(f"refused in {time.monotonic() - started:.1f} s")


def test_a_use_cache_lm_eval_cannot_keep_is_one_line_before_anything_runs(tmp_path):
    """`--use_cache PATH` whose sqlite file is a folder failed inside lm-eval after every request had run; now one
    line at the start, as a spec's `use_cache:` is refused."""
    from jobs.lm_eval_command import check_options
    from jobs.lm_eval_run import LmEvalError

    (tmp_path / "c_rank0.db").mkdir()
    # lm-eval's short form and an abbreviation, which its parser takes (the short form was a FileExistsError traceback)
    for argv in (["--use_cache", str(tmp_path / "c")], [f"--use_cache={tmp_path / 'c'}"], ["-c", str(tmp_path / "c")],
                 ["--use_ca", str(tmp_path / "c")]):
        with pytest.raises(LmEvalError, match=r"^--use_cache: .*c_rank0\.db is not a regular file"):
            check_options(["--model", "raysweep", "--tasks", "t", *argv])
    (tmp_path / "file").write_text("x")
    with pytest.raises(LmEvalError, match="is not a folder"):
        check_options(["--tasks", "t", "--use_cache", str(tmp_path / "file" / "c")])
    check_options(["--tasks", "t", "--use_cache", str(tmp_path / "fresh" / "c")])  # a folder lm-eval makes: fine


def test_a_samples_path_that_is_not_there_or_a_limit_of_0_is_one_line_before_anything_runs(tmp_path):
    """A mistyped --samples file was lm-eval's AttributeError traceback (it took the path for a mapping's JSON);
    --limit 0 was its "did not find any docs" traceback."""
    from jobs.lm_eval_command import check_options
    from jobs.lm_eval_run import LmEvalError

    with pytest.raises(LmEvalError, match=f"^--samples {tmp_path}/nope.json: neither a JSON mapping of task to "
                                          "document indices nor a file holding one$"):
        check_options(["--tasks", "t", "--samples", str(tmp_path / "nope.json")])
    (tmp_path / "s.json").write_text('{"t": [0]}')
    check_options(["--tasks", "t", "--samples", str(tmp_path / "s.json")])  # a file: lm-eval reads it
    check_options(["--tasks", "t", "--samples", '{"t": [0]}'])
    for limit in ("0", "-2", "0.0"):
        with pytest.raises(LmEvalError, match=r"^--limit -?0|^--limit -2"):
            check_options(["--tasks", "t", "--limit", limit])
    check_options(["--tasks", "t", "--limit", "0.5"])


def test_a_dataset_lm_eval_cannot_load_is_told_by_its_error_type_not_its_name():
    """The errors that mean "no dataset here" (datasets', the hub's, requests') are recognised by their types,
    exactly: a subclass of one says something else (a connection Ray lost, a gated repository), and a
    ValueError of the task's own is no data error either."""
    import requests
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled

    from cluster.lm_eval.requests import data_failure, is_data_error

    for error in (DatasetNotFoundError("gone"), DataFilesNotFoundError("gone"), EmptyDatasetError("empty"),
                  OfflineModeIsEnabled("offline"), LocalEntryNotFoundError("not cached"),
                  requests.exceptions.ConnectionError("no route"), FileNotFoundError("data.json")):
        assert is_data_error(error), type(error)
        assert data_failure(error).startswith(f"lm-eval could not load the dataset ({type(error).__name__}: ")
    gated = GatedRepoError.__new__(GatedRepoError)  # its constructor wants an HTTP response
    for error in (ValueError("a bad doc_to_text"), ConnectionResetError("by peer"), BrokenPipeError(), gated):
        assert not is_data_error(error), type(error)


@pytest.mark.parametrize("model_args, extra, line", [
    ("pretrained=builtin:nosuch", [],
     "raysweep: error: --model_args: pretrained: builtin:nosuch: unknown builtin model; known: builtin:tiny"),
    ("pretrained=nobody/no-model", ["--apply_chat_template"],
     "raysweep: error: --apply_chat_template: model nobody/no-model: its tokenizer cannot be loaded: "),
])
def test_a_model_lm_eval_cannot_use_is_one_line_not_a_traceback(include_path, model_args, extra, line):
    """An unknown builtin model was a ValueError traceback; --apply_chat_template on a model whose tokenizer cannot
    load, lm-eval's NotImplementedError traceback (`please implement the 'tokenizer_name' property`)."""
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "lm-eval", "--model", "raysweep", "--model_args",
                           f"{model_args},actors=1", "--include_path", str(include_path), "--tasks", "rs_mc",
                           "--limit", "2", *extra], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    said = [s for s in proc.stderr.splitlines() if s.startswith("raysweep: error:")]
    assert proc.returncode == 2 and len(said) == 1 and said[0].startswith(line), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_no_tasks_or_a_model_folder_that_is_not_there_is_one_line_before_anything_starts(tmp_path):
    """No --tasks was lm-eval's ValueError traceback; a model folder that is not there was said (as `<spec>: model
    model: ...`) only once Ray had started."""
    from jobs.lm_eval_command import check_options
    from jobs.lm_eval_model import RaysweepLM
    from jobs.lm_eval_run import LmEvalError

    with pytest.raises(LmEvalError, match=r"^--tasks: none named: name the lm-eval tasks to run"):
        check_options(["--model", "raysweep", "--model_args", "pretrained=builtin:tiny"])
    for fine in (["--help"], ["ls", "tasks"], ["--config", "c.yaml"], ["--tasks", "a,b"], ["--tasks=a"],
                 ["--task", "a"]):  # `--task`: lm-eval's parser takes it for --tasks (it was "none named")
        check_options(fine)
    with pytest.raises(LmEvalError, match=f"^--model_args: pretrained={tmp_path}/m: no such directory$"):
        RaysweepLM(pretrained=str(tmp_path / "m"))


def test_a_resume_refused_for_other_requests_says_so_and_names_the_output_folder_to_remove():
    """The same output= with another --limit was "holds results of another spec: name changed", and the advice named
    the request type's sub-folder: removing it, the next type's sweep was refused the same way."""
    from jobs.lm_eval_model import lm_eval_advice

    refused = ("output /r/loglikelihood holds results of another spec: name changed (hash 491149c34e7ad438, this one is "
               "88bf593685a137bc); use a new output, or --new-run to discard them")
    assert lm_eval_advice(refused, "/r") == (
        "output /r/loglikelihood holds results of other lm-eval requests (tasks or settings changed: --tasks, --limit, "
        "--num_fewshot, ...) (hash 491149c34e7ad438, this one is 88bf593685a137bc); use another output= in "
        "--model_args, or remove the folder /r to discard them")
