"""No silent wait: jobs/silence.py says what a command waits on after each stretch of silence, and `raysweep
lm-eval` names lm-eval's stages to it."""

import sys
import time

import pytest

import jobs.silence as silence
from jobs.silence import SilenceWatch


def test_a_stage_is_said_after_each_silence_and_a_sweep_is_not():
    lines = []
    with SilenceWatch(lines.append, after_s=0.2) as watch:
        watch.stage("lm-eval indexes its tasks")
        deadline = time.monotonic() + 30
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.stage(None)  # a sweep: it says its own progress
        said = len(lines)
        time.sleep(0.6)
    assert said == 2 and len(lines) == 2, lines
    assert lines[0].startswith("[raysweep] still waiting: lm-eval indexes its tasks (0s so far; load ")


def test_raysweep_lm_eval_says_what_lm_eval_is_at_while_it_indexes(tmp_path, monkeypatch, capsys):
    """lm-eval indexing its own task files (seconds here, 50 s on a busy machine) before it names the task it
    cannot load: a line of what it waits on, from the first stage on."""
    pytest.importorskip("lm_eval")
    from jobs.lm_eval_command import run

    monkeypatch.setattr(silence, "SAY_AFTER_S", 0.5)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(Exception, match="could not load the dataset"):
        run(["--model", "raysweep", "--model_args", "pretrained=builtin:tiny,actors=1", "--tasks", "arc_easy",
             "--limit", "2"])
    err = capsys.readouterr().err
    assert "[raysweep] still waiting: lm-eval reads its command line and indexes its tasks (" in err, err[-3000:]
