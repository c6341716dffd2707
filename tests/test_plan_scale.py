"""Plans of many models: a model folder is loaded and its token counts read once however many models name it,
and `raysweep plan` says what it plans before it plans it, then how far it got."""

import io
import json
import subprocess
import sys
import time

import cluster.plan.plan_source as plan_source
from cluster.inputs.spec_file import load_spec
from cluster.plan.plan_source import pair_count, preflight

MODELS = 2000


def _spec(tmp_path, models: int, replay: bool = False):
    with open(tmp_path / "t.jsonl", "w") as f:
        f.writelines(json.dumps({"id": i, "q": f"question {i}", "c": "x"}) + "\n" for i in range(4))
    tasks = [{"name": "t", "data": "t.jsonl", "id_column": "id", "prompt": "{q}"}]
    if replay:
        tasks.append({"name": "r", "data": "t.jsonl", "id_column": "id", "prompt": "{q}",
                      "replay": {"model": "earlier", "column": "c"}})
    spec = {"name": "many", "output": "out", "models": [{"name": f"m{i}", "path": "builtin:tiny"} for i in range(models)],
            "tasks": tasks}
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    return tmp_path / "s.yaml"


def test_models_of_one_folder_share_one_load_and_one_token_cache(tmp_path, monkeypatch):
    loads, caches = [], []
    load, cache = plan_source.load_model_meta, plan_source.TokenCache
    monkeypatch.setattr(plan_source, "load_model_meta", lambda *a: loads.append(a) or load(*a))
    monkeypatch.setattr(plan_source, "TokenCache", lambda tok: caches.append(tok) or cache(tok))
    spec = load_spec(_spec(tmp_path, MODELS))
    counts = []
    plans = preflight(spec, planned=counts.append)
    assert len(loads) == 1 and len(caches) == 1  # each model loaded and read its own: 2,000 of each
    assert counts == list(range(1, MODELS + 1)) and pair_count(spec) == MODELS
    assert [p.model.name for p in plans] == [f"m{i}" for i in range(MODELS)]
    assert all(len(p.tasks) == 1 and len(p.tasks[0].lengths) == 4 for p in plans)


def test_a_model_s_own_max_model_len_is_kept_when_its_folder_is_shared(tmp_path):
    path = _spec(tmp_path, 2)
    raw = json.loads(path.read_text())
    raw["models"][1]["engine"] = {"max_model_len": 24}
    raw["tasks"][0]["sampling"] = {"max_tokens": 20}
    path.write_text(json.dumps(raw))
    plans = {p.model.name: p.tasks[0] for p in preflight(load_spec(path), strict=False)}
    assert plans["m0"].limit > 1000 and plans["m1"].limit == 4


def test_raysweep_plan_says_what_it_plans_and_how_far_it_got(tmp_path, monkeypatch):
    """Nothing on stderr for a quick plan (the table alone on stdout); past FIRST_S, the pairs and how many are
    planned, every EVERY_S. A replay task is planned once."""
    import jobs.plan_ticker as ticker

    spec = _spec(tmp_path, 300, replay=True)
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "plan", str(spec)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.splitlines()
    assert table[0].startswith("| model | task |") and len(table) == 2 + 301
    monkeypatch.setattr(ticker, "FIRST_S", 0.0)
    monkeypatch.setattr(ticker, "EVERY_S", 0.01)
    lines = io.StringIO()
    deadline = time.monotonic() + 60  # a ticker that says nothing fails here, not by hanging the suite
    with ticker.PlanTicker(load_spec(spec), lines) as t:
        while lines.getvalue().count("\n") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        t.planned(7)
        seen = lines.getvalue().count("\n")
        while lines.getvalue().count("\n") == seen and time.monotonic() < deadline:
            time.sleep(0.01)
    said = lines.getvalue().splitlines()
    assert said[0] == "[raysweep] planning 301 (model, task) pair(s) of 300 model(s) and 2 task(s)"
    assert said[1].startswith("[raysweep] planned 0/301 pairs (") and said[-1].startswith("[raysweep] planned 7/301")
