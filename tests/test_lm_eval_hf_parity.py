"""What the CPU engine reads for lm-eval's requests, against lm-eval's own HF model: where a context is cut for each
request type, with the `max_length` docs/lm-eval.md's table ("How long a context may be") gives lm-eval's models and
a small max_model_len that cuts most contexts; and log-likelihoods one row at a time (`reproducible: true`)
bit-equal to `--model hf --batch_size 1`.

raysweep's planner and actor (cluster/plan/planner.py, actors/shard_work.py) run the rows of a `lm_eval:` entry
through the CPU engine (actors/hf_engine.py) in this process; lm-eval's HFLM runs the same requests, its model
calls recorded. No Ray.
"""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.conftest import LM_EVAL, ROOT  # noqa: E402
from tests.test_lm_eval_tasks import write_tasks  # noqa: E402

N = 64  # max_model_len: a 2-shot context of the fixture tasks is 100-300 tokens (a byte-level tokenizer)
GEN_TOKENS = 12  # rs_gen's max_gen_toks


def documented(kind: str) -> tuple[int, int]:
    """The `max_length` docs/lm-eval.md's table gives lm-eval's HF and vLLM models for a request type, for a
    max_model_len of N."""
    row = next(line for line in (ROOT / "docs" / "lm-eval.md").read_text().splitlines() if line.startswith(f"| `{kind}`"))
    hf, vllm = re.findall(r"`max_length = max_model_len( - 2)?`", row)
    return N - (2 if hf else 0), N - (2 if vllm else 0)


class Recorded:
    """A model (or a model's generate) whose calls' token ids are kept, in order."""

    def __init__(self, call):
        self.call, self.inputs = call, []

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids", kwargs.get("context", args[0] if args else None))
        self.inputs.append(tuple(ids[0].tolist()))
        return self.call(*args, **kwargs)


@pytest.fixture(scope="module")
def planned(tmp_path_factory, tiny_path):
    """The entry's tasks as raysweep plans them for max_model_len N, lm-eval's requests for them, and the
    CPU engine one row at a time."""
    from transformers import AutoTokenizer

    from actors.engine import EngineProfile
    from actors.hf_engine import HFEngine
    from cluster.lm_eval.requests import record
    from cluster.inputs.spec_file import load_spec
    from cluster.lm_eval.run import task_manager

    folder = tmp_path_factory.mktemp("lengths")
    include = write_tasks(folder)
    entry = {"tasks": ["rs_mc", "rs_gen", "rs_ppl"], "include_path": str(include), "num_fewshot": 2, "limit": 6}
    (folder / "s.yaml").write_text(json.dumps({
        "name": "lengths", "output": str(folder / "out"), "tasks": [{"lm_eval": entry}],
        "models": [{"name": "tiny", "path": "builtin:tiny", "engine": {"max_model_len": N}}]}))
    spec = load_spec(folder / "s.yaml")
    settings = spec.tasks[0].lm_eval.settings
    engine = HFEngine(spec.models[0], tiny_path, EngineProfile(), one_row_at_a_time=True)
    return {"spec": spec, "requests": record(settings, task_manager(settings)), "engine": engine,
            "tokenizer": AutoTokenizer.from_pretrained(tiny_path)}


def answers_of(planned: dict, task_name: str, engine) -> tuple[dict, list]:
    """raysweep's results rows of one task (planned for N, run through `engine`) and the truncated rows' ids."""
    from actors.shard_work import run_rows
    from cluster.contracts.spec import ShardLimits
    from cluster.inputs.data import load_task
    from cluster.plan.planner import plan_task

    spec = planned["spec"]
    task = next(t for t in spec.tasks if t.name == task_name)
    plan = plan_task(spec.models[0], load_task(spec, task), planned["tokenizer"], N, ShardLimits())
    rows = [r for shard in plan.shards for r in shard.rows.to_pylist()]
    done = run_rows(engine, rows, task, planned["tokenizer"], plan.shards[0].add_special_tokens)
    return {task_name: {(r["sample_id"], 0): r for r in done.rows}}, rows


def lm_evals_hf(tiny_path: str, max_length: int):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=tiny_path, dtype="float32", max_length=max_length, batch_size=1, device="cpu")


@pytest.mark.parametrize("kind", ["loglikelihood", "loglikelihood_rolling"])
def test_log_likelihoods_read_what_lm_evals_hf_model_reads_at_max_length_less_2_and_equal_its_bit_for_bit(
        planned, tiny_path, kind):
    """A cut multiple-choice context and a rolling document's windows: the CPU engine's model is given the very
    token ids lm-eval's HF model is given with max_length = max_model_len - 2 (the continuation's last token
    dropped, as lm-eval's HFLM does), and one row at a time each request's log-likelihood is bit-equal to its
    batch-1 result. The requests themselves (context + continuation) are what lm-eval's vLLM model keeps with
    max_length = max_model_len: their last max_model_len - 1 tokens."""
    from cluster.lm_eval.scores import replay_lm

    task = "rs_mc" if kind == "loglikelihood" else "rs_ppl"
    requests = [r for r in planned["requests"] if r.task_name == task]
    hf, vllm = documented(kind)
    assert (hf, vllm) == (N - 2, N)
    lm = lm_evals_hf(tiny_path, hf)
    lm._model_call = theirs = Recorded(lm._model_call)
    expected = getattr(lm, kind)(requests)
    engine, sent = planned["engine"], []
    model, engine.model = engine.model, Recorded(engine.model)
    engine.loglikelihood = lambda reqs: sent.extend(tuple(r.context_ids + c) for r in reqs for c in r.continuations) \
        or type(engine).loglikelihood(engine, reqs)
    try:
        answers, rows = answers_of(planned, task, engine)
        ours = engine.model.inputs
    finally:
        engine.model = model
        del engine.loglikelihood
    assert Counter(ours) == Counter(theirs.inputs) and max(map(len, ours)) == N - 2
    assert getattr(replay_lm(answers), kind)(requests) == expected  # bit-equal, greedy flags too
    assert max(map(len, sent)) == N - 1
    if kind == "loglikelihood":
        assert sum(r["status"] == "truncated" for r in rows) == len(rows)  # every 2-shot context was cut
        # lm-eval's vLLM model sends (context + continuation)[-(max_length - 1):]
        assert Counter(sent) == Counter(tuple((ctx + cont)[-(vllm - 1):]) for ctx, cont in
                                        (lm._encode_pair(*r.args) for r in requests))
    else:
        assert len(sent) > sum(bool(r.args[0]) for r in requests)  # documents of several windows


def test_a_generation_prompt_is_cut_to_max_model_len_less_max_gen_toks_as_lm_evals_models_cut_it(planned, tiny_path):
    """A `generate_until` prompt too long keeps its last max_model_len - max_gen_toks tokens: what lm-eval's HF
    model gives `generate` with max_length = max_model_len (not max_model_len - 2, as for log-likelihoods), and
    lm-eval's `maybe_truncate`, its vLLM model's cut, with max_model_len."""
    import torch
    from lm_eval.models.utils import maybe_truncate

    requests = sorted((r for r in planned["requests"] if r.task_name == "rs_gen"), key=lambda r: r.doc_id)
    hf, vllm = documented("generate_until")
    assert hf == vllm == N
    lm = lm_evals_hf(tiny_path, hf)
    eos = torch.tensor([[lm.eot_token_id]])
    lm._model_generate = generated = Recorded(lambda context, **kwargs: torch.cat([context, eos], dim=1))
    lm.generate_until(requests)
    _, rows = answers_of(planned, "rs_gen", planned["engine"])
    ours = {int(r["sample_id"]): tuple(r["prompt_token_ids"]) for r in rows}
    assert Counter(ours.values()) == Counter(generated.inputs)  # one generate per request (lm-eval's order)
    assert len(ours) == len(requests) and {len(ids) for ids in ours.values()} == {N - GEN_TOKENS}
    tokenizer = planned["tokenizer"]
    for r in requests:
        full = tokenizer(r.args[0])["input_ids"]
        assert len(full) > N - GEN_TOKENS
        assert tuple(maybe_truncate(full, GEN_TOKENS, vllm, verbose=False)[0]) == ours[r.doc_id]


def with_perplexity_task(folder) -> str:
    """The fixture tasks and rs_last, a `loglikelihood` task (each question's right answer) with lm-eval's
    `perplexity` metric, whose stderr lm-eval bootstraps (and says so on stdout)."""
    include = write_tasks(folder)
    mc = (include / "rs_mc.yaml").read_text()
    last = re.sub(r"doc_to_choice: .*\n", "", mc.replace("task: rs_mc\n", "task: rs_last\n").replace(
        "output_type: multiple_choice", "output_type: loglikelihood").replace(
        "doc_to_target: label", 'doc_to_target: " {{choices[label]}}"'))
    (include / "rs_last.yaml").write_text(last.split("metric_list:")[0] + textwrap.dedent("""\
        metric_list:
          - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
          - {metric: acc, aggregation: mean, higher_is_better: true}
        """))
    return str(include)


@pytest.mark.slow
def test_reproducible_log_likelihoods_are_lm_evals_hf_batch_1_bit_for_bit_and_the_run_prints_only_its_own_lines(
        tmp_path, tiny_path, ray_local):
    """`reproducible: true` on the CPU: every log-likelihood lm-eval's records hold (multiple choice, rolling
    windows, a single continuation) is bit-equal to `lm_eval --model hf --batch_size 1` in float32, and so are
    the metrics and their stderr. The run's stdout is raysweep's lines and its table only: lm-eval's
    `bootstrapping for stddev: perplexity` printed itself among them, by the table."""
    from tests.test_lm_eval_tasks import MAX_MODEL_LEN, _env

    include = with_perplexity_task(tmp_path / "fx")
    tasks = ["rs_mc", "rs_ppl", "rs_last"]
    spec = tmp_path / "repro.yaml"
    spec.write_text(json.dumps({"name": "repro", "output": str(tmp_path / "out"), "reproducible": True,
                                "models": [{"name": "tiny", "path": "builtin:tiny",
                                            "engine": {"max_model_len": MAX_MODEL_LEN}}],
                                "tasks": [{"lm_eval": {"tasks": tasks, "include_path": include, "num_fewshot": 2}}]}))
    run = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(spec)], cwd=ROOT, env=_env(ray_local),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    strays = [line for line in run.stdout.splitlines() if line.strip() and not line.startswith(("[raysweep] ", "|"))]
    assert not strays and "| tiny | rs_last |" in run.stdout, run.stdout
    hf_length, _ = documented("loglikelihood")
    subprocess.run(
        [*LM_EVAL, "--model", "hf", "--model_args",
         f"pretrained={tiny_path},dtype=float32,max_length={MAX_MODEL_LEN - (N - hf_length)}", "--tasks",
         ",".join(tasks), "--include_path", include, "--num_fewshot", "2", "--device", "cpu", "--batch_size", "1",
         "--output_path", str(tmp_path / "reference"), "--log_samples"],
        check=True, env=_env(), capture_output=True, text=True, timeout=600)
    theirs = Path(glob.glob(f"{tmp_path / 'reference'}/*/results_*.json")[0]).parent
    ours = tmp_path / "out" / "lm_eval" / "tiny"
    results = [json.loads(next(folder.glob("results_*.json")).read_text())["results"] for folder in (theirs, ours)]
    for task in tasks:
        assert results[0][task] == results[1][task], task  # acc, perplexities, bits per byte, stderr: exactly
        records = [{(r["doc_id"], r["filter"]): r for r in map(json.loads, next(folder.glob(f"samples_{task}_*.jsonl"))
                                                                .read_text().splitlines())} for folder in (theirs, ours)]
        assert records[0].keys() == records[1].keys() and records[0]
        for key, record in records[0].items():
            mine = records[1][key]
            assert (mine["resps"], mine["filtered_resps"]) == (record["resps"], record["filtered_resps"]), (task, key)
            assert {m: mine[m] for m in record["metrics"]} == {m: record[m] for m in record["metrics"]}, (task, key)
