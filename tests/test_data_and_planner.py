"""Task data errors name file and line; prompts render; the planner sorts, cuts and profiles shards."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.inputs.data import DataError, load_task, render_prompts
from cluster.contracts.errors import PreflightError
from cluster.plan.planner import chunk_threshold, plan_task
from cluster.contracts.spec import ModelSpec, ShardLimits, SweepSpec, TaskSpec


def make(tmp_path, lines: list[str], **task_fields):
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    fields = dict(name="t", data="d.jsonl", prompt="Q: {q}", target="a") | task_fields
    task = TaskSpec(**fields)
    spec = SweepSpec(name="s", output=str(tmp_path / "out"), models=(ModelSpec("m", "builtin:tiny"),),
                     tasks=(task,), base_dir=str(tmp_path))
    return spec, task


@pytest.mark.parametrize("lines, fields, message", [
    (['{"q": "1", "a": "1"}', '{"q": "2", "a": '], {}, "d.jsonl:2: not valid JSON"),
    (['{"q": "1", "a": "1"}', '[1, 2]'], {}, "d.jsonl:2: expected a JSON object"),
    (['{"q": "1", "a": "1"}', '', '{"a": "2"}'], {}, "d.jsonl:3: missing column 'q'"),
    (['{"q": "1"}'], {}, "d.jsonl:1: missing column 'a'"),
    (['{"q": "1", "a": "1", "id": 7}', '{"q": "2", "a": "2", "id": 7}'], {"id_column": "id"},
     "d.jsonl:2: duplicate sample id '7' (first at 1)"),
    ([''], {}, "has no rows"),
])
def test_data_errors_name_file_and_line(tmp_path, lines, fields, message):
    spec, task = make(tmp_path, lines, **fields)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_task(spec, task)


def test_missing_file_and_parquet(tmp_path):
    spec, task = make(tmp_path, ['{"q": "1", "a": "1"}'])
    (tmp_path / "d.jsonl").unlink()
    with pytest.raises(DataError, match="d.jsonl: no such data file"):
        load_task(spec, task)
    pq.write_table(pa.table({"q": ["x", "y"], "a": ["1", "2"]}), tmp_path / "d.parquet")
    spec, task = make(tmp_path, [], data="d.parquet")
    data = load_task(spec, task)
    batch = next(data.batches())
    assert data.n_rows == 2 and batch.ids == ["0", "1"] and [data.target_of(r) for r in batch.rows] == ["1", "2"]


def test_chat_rendering_uses_the_models_template(tmp_path, tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    msgs = json.dumps({"msgs": [{"role": "user", "content": "hello"}], "a": "x"})
    spec, task = make(tmp_path, [msgs], prompt=None, messages="msgs", system="be brief")
    prompts, add_special = render_prompts(task, next(load_task(spec, task).batches()), tok)
    assert prompts == ["<|system|>be brief<|end|><|user|>hello<|end|><|assistant|>"] and add_special is False
    spec, task = make(tmp_path, ['{"q": "2+2", "a": "4"}'], chat=True)
    assert render_prompts(task, next(load_task(spec, task).batches()), tok)[0] == ["<|user|>Q: 2+2<|end|><|assistant|>"]


@pytest.mark.parametrize("lengths, expected", [
    ([10] * 100 + [999], None),  # longest under 1,000: chunked prefill off
    ([100] * 90 + [1500] * 10, 2048),  # p95 under 2,048
    ([4000] * 100, 3200),  # else 0.8 x p95
])
def test_chunk_threshold(lengths, expected):
    assert chunk_threshold(np.array(lengths)) == expected


def test_plan_sorts_cuts_and_applies_length_policy(tmp_path, tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = [json.dumps({"q": "x" * n, "a": "1"}) for n in (50, 3, 20, 9, 40, 1)]
    spec, task = make(tmp_path, rows)
    plan = plan_task(spec.models[0], load_task(spec, task), tok, None, ShardLimits(max_samples=2))
    lengths = [r for s in plan.shards for r in s.rows["prompt_tokens"].to_pylist()]
    assert lengths == sorted(lengths) and [s.n_samples for s in plan.shards] == [2, 2, 2]
    assert len({sid for s in plan.shards for sid in s.rows["sample_id"].to_pylist()}) == 6
    assert [s.shard_id for s in plan.shards] == ["m/t/00000", "m/t/00001", "m/t/00002"]
    # token budget: prompt + max_tokens per sample
    budget = ShardLimits(max_samples=100, max_tokens=2 * (task.sampling.max_tokens + 10))
    assert [s.n_samples for s in plan_task(spec.models[0], load_task(spec, task), tok, None, budget).shards] == [2, 1, 1, 1, 1]
    # length policy against max_model_len - max_tokens = 300 - 256 = 44 prompt tokens ("Q: " + 50 x's = 53)
    with pytest.raises(PreflightError, match=r"1 prompt\(s\) over the limit of 44 tokens.*sample_id=0 tokens=53"):
        plan_task(spec.models[0], load_task(spec, task), tok, 300, ShardLimits())
    for policy, status in (("skip", "skipped"), ("truncate_left", "truncated")):
        spec, task = make(tmp_path, rows, length_policy=policy)
        plan = plan_task(spec.models[0], load_task(spec, task), tok, 300, ShardLimits())
        table = plan.shards[0].rows.to_pylist()
        over = next(r for r in table if r["sample_id"] == "0")
        assert over["status"] == status
        if policy == "truncate_left":
            assert over["prompt_tokens"] == 44 and over["prompt_token_ids"] == tok("Q: " + "x" * 50)["input_ids"][-44:]


@pytest.mark.parametrize("policy", ["error", "truncate_left", "skip"])
def test_max_tokens_that_leave_no_room_for_a_prompt_are_said_so(tmp_path, tiny_path, policy):
    """The planner's own check, for a model whose length is known only once it is loaded (a hub id):
    no negative limit, and no length_policy advice that cannot help."""
    from transformers import AutoTokenizer

    spec, task = make(tmp_path, [json.dumps({"q": "x", "a": "1"})], length_policy=policy)
    with pytest.raises(PreflightError) as err:
        plan_task(spec.models[0], load_task(spec, task), AutoTokenizer.from_pretrained(tiny_path), 256, ShardLimits())
    assert str(err.value) == ("tasks.t.sampling.max_tokens 256 leaves no room for a prompt in model m's "
                              "max_model_len 256; lower max_tokens")


@pytest.mark.parametrize("lines, prompt, message", [
    (['{"q": "1", "a": "1"}', '{"q": 2, "a": "1"}'], "Q: {q:d}", "d.jsonl:1: tasks.t.prompt 'Q: {q:d}' cannot be "
     "rendered from this row: ValueError: Unknown format code 'd' for object of type 'str'"),
    (['{"q": [1, 2], "a": "1"}', '{"q": [1], "a": "1"}'], "Q: {q[1]}", "d.jsonl:2: tasks.t.prompt 'Q: {q[1]}' cannot "
     "be rendered from this row: IndexError: list index out of range"),
    (['{"q": "1", "a": "1"}', '{"q": "\\udc00", "a": "1"}'], "Q: {q}", "d.jsonl:2: column 'q' holds a lone surrogate"),
    (['{"q": {"k\\ud800": 1}, "a": "1"}'], "Q: {q}", "d.jsonl:1: column 'q' holds a lone surrogate"),
])
def test_every_row_renders_and_is_text(tmp_path, lines, prompt, message):
    spec, task = make(tmp_path, lines, prompt=prompt)
    with pytest.raises(DataError) as err:
        load_task(spec, task)
    assert str(err.value).startswith(f"{tmp_path}/{message}")


def test_a_surrogate_pair_written_as_escapes_is_text(tmp_path):
    spec, task = make(tmp_path, ['{"q": "\\ud83d\\ude00", "a": "1"}'])
    assert next(load_task(spec, task).batches()).rows[0]["q"] == "\U0001F600"


def test_fast_tokenize_equals_the_tokenizers_own_call(tiny_path):
    from transformers import AutoTokenizer

    from cluster.contracts.tokens import tokenize

    tok = AutoTokenizer.from_pretrained(tiny_path)
    texts = ["plain", "naïve ünïcode ✓", "<|user|>hi<|end|><|assistant|>", ""]
    for special in (True, False):
        assert tokenize(texts, tok, special) == tok(texts, add_special_tokens=special)["input_ids"]


def test_token_counts_are_cached_per_tokenizer_and_prompt(tmp_path, tiny_path):
    from transformers import AutoTokenizer

    from cluster.contracts.tokens import count_tokens
    from cluster.inputs.token_cache import TokenCache

    tok = AutoTokenizer.from_pretrained(tiny_path)
    calls = []

    def count(prompts):
        calls.append(len(prompts))
        return count_tokens(prompts, tok, True)

    prompts = [f"prompt number {i}" * (i % 5 + 1) for i in range(100)]
    cache = TokenCache(tok, root=tmp_path)
    first = cache.lengths(prompts, True, count)
    cache.flush()  # what a planner does when a task is planned
    again = TokenCache(tok, root=tmp_path)  # a new planner process: reads the cache from disk
    second = again.lengths(prompts + ["a new one"], True, count)
    assert list(second[:100]) == list(first) == count_tokens(prompts, tok, True)
    assert calls == [100, 1] and again.hits == 100 and again.misses == 1
    assert list(TokenCache(tok, root=tmp_path).lengths(prompts[:3], False, count)) == count_tokens(prompts[:3], tok, False)
    assert calls[-1] == 3  # the add-special-tokens flag is part of the key


def test_chunked_prefill_override_and_same_plan_twice(tmp_path, tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = [json.dumps({"q": "x" * (3000 if i % 4 == 0 else 30), "a": "1"}) for i in range(40)]
    profiles = {}
    for mode in ("auto", "on", "off"):
        spec, task = make(tmp_path, rows, chunked_prefill=mode)
        plan = plan_task(spec.models[0], load_task(spec, task), tok, None, ShardLimits(max_samples=10))
        profiles[mode] = [(s.profile, s.max_num_batched_tokens) for s in plan.shards]
        again = plan_task(spec.models[0], load_task(spec, task), tok, None, ShardLimits(max_samples=10))
        assert len(plan.shards) == len(again.shards)
        assert all(s.rows.equals(t.rows) and s.shard_id == t.shard_id for s, t in zip(plan.shards, again.shards))
    assert profiles["auto"] == [("short", None)] * 3 + [("long", 2402)]  # p95 3003 >= 2048: 0.8 x 3003
    assert profiles["on"] == [("long", 2402)] * 4
    assert profiles["off"] == [("short", None)] * 4


def test_a_loglikelihood_task_runs_short_unless_it_asks_for_chunked_prefill(tmp_path, tiny_path):
    """Its shards decode nothing: long contexts (3,000 tokens, over any threshold) stay on the short profile,
    so no engine restarts for them; `chunked_prefill: on` still gives every shard the long one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = [json.dumps({"q": "x" * (3000 if i % 4 == 0 else 30), "c": [" a", " b"], "a": 0}) for i in range(40)]
    profiles = {}
    for mode in ("auto", "on"):
        spec, task = make(tmp_path, rows, prompt="{q}", type="loglikelihood", choices="c", chunked_prefill=mode)
        plan = plan_task(spec.models[0], load_task(spec, task), tok, None, ShardLimits(max_samples=10))
        profiles[mode] = {s.profile for s in plan.shards}
    assert profiles == {"auto": {"short"}, "on": {"long"}}


def test_a_long_engine_runs_every_long_shard_whatever_its_tasks_chunk_size():
    """Each task's threshold is its own: a long engine started for one task's chunk runs another's long shard
    without a restart (four mmlu subjects of long contexts cost an 8B engine four restarts of about 55 s on
    an H200 before); the other profile still restarts it; the CPU engine runs every profile."""
    from types import SimpleNamespace

    from actors.engine import EngineProfile, runs_profile

    long_a, long_b = (EngineProfile("long", True, n) for n in (2085, 1875))
    vllm = SimpleNamespace(kind="vllm", profile=long_a)
    assert runs_profile(vllm, long_b) and runs_profile(vllm, long_a)
    assert not runs_profile(vllm, EngineProfile())
    assert not runs_profile(SimpleNamespace(kind="vllm", profile=EngineProfile()), long_a)
    assert runs_profile(SimpleNamespace(kind="hf", profile=EngineProfile()), long_a)


def test_plan_cli_json(tmp_path):
    import subprocess
    import sys

    from tests.conftest import QUICKSTART, ROOT

    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "plan", str(QUICKSTART), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {r["task"]: r for r in json.loads(proc.stdout)}
    assert rows["arithmetic"]["samples"] == 150 and rows["arithmetic"]["shards"] == 3
    assert rows["extract"]["tokens_max"] >= rows["extract"]["tokens_p95"] >= rows["extract"]["tokens_p50"]
    assert all(r["long_shards"] == 0 and r["refused"] == 0 for r in rows.values())


def test_names_of_any_allowed_length_plan_and_a_longer_one_is_one_line(tmp_path):
    """A model and a task named with 250 characters each: `raysweep plan` plans them (its staging file was
    MODEL+TASK, 501 characters: OSError File name too long); a 256-character name is refused in one line (names
    are folder names under results/)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"q": f"{i}+{i}", "a": str(2 * i)}) + "\n" for i in range(5)))

    def plan(model: str, task: str) -> subprocess.CompletedProcess:
        (tmp_path / "s.yaml").write_text(json.dumps({
            "name": "long-names", "output": str(tmp_path / "out"), "models": [{"name": model, "path": "builtin:tiny"}],
            "tasks": [{"name": task, "data": "d.jsonl", "prompt": "{q}=", "target": "a"}]}))
        return subprocess.run([sys.executable, "-m", "jobs.cli", "plan", str(tmp_path / "s.yaml"), "--json"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    done = plan("m" * 250, "t" * 250)
    assert done.returncode == 0, done.stderr
    assert [(r["model"], r["task"], r["samples"]) for r in json.loads(done.stdout)] == [("m" * 250, "t" * 250, 5)]
    refused = plan("m" * 256, "t")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "is 256 characters; at most 255" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_a_shard_never_mixes_models_or_tasks(tmp_path):
    import yaml

    from cluster.plan.plan_source import preflight
    from cluster.inputs.spec_file import load_spec
    from tests.conftest import QUICKSTART

    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["models"].append({"name": "tiny2", "path": "builtin:tiny"})
    for task in raw["tasks"]:
        task["data"] = str(QUICKSTART.parent / task["data"])
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(raw))
    seen = set()
    spec = load_spec(tmp_path / "two.yaml")
    for mp in preflight(spec):
        for tp in mp.tasks:
            ids = {sid for batch in load_task(spec, tp.task).batches() for sid in batch.ids}
            for shard in tp.shards:
                assert shard.model == mp.model.name and shard.task == tp.task.name
                assert shard.shard_id.startswith(f"{mp.model.name}/{tp.task.name}/")
                assert set(shard.rows["sample_id"].to_pylist()) <= ids
                seen.add(shard.shard_id)
    assert len(seen) == 2 * 7  # every shard id unique across models and tasks


def test_a_killed_planners_staging_is_removed_by_the_next(tmp_path):
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from cluster.inputs.staging import StagingFolder
    from tests.conftest import ROOT

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = ("from cluster.inputs.staging import StagingFolder; import os; f = StagingFolder(); print(f.path, flush=True); "
            "os.kill(os.getpid(), 9)")
    left = Path(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True).stdout.strip())
    assert left.parent == tmp_path and left.exists()  # SIGKILL: no chance to clean up
    tempfile.tempdir = str(tmp_path)
    try:
        mine = StagingFolder()
    finally:
        tempfile.tempdir = None
    assert not left.exists() and mine.path.exists()
    path = mine.path
    del mine  # the last reference: its folder goes with it
    assert not path.exists()


def test_a_bom_at_the_start_of_a_jsonl_file_is_skipped(tmp_path):
    """Editors on Windows save one; Python's "decode using utf-8-sig" advice is no error message."""
    import codecs

    spec, task = make(tmp_path, ['{"q": "1", "a": "1"}', '{"q": "2", "a": "2"}'])
    (tmp_path / "d.jsonl").write_bytes(codecs.BOM_UTF8 + (tmp_path / "d.jsonl").read_bytes())
    data = load_task(spec, task)
    assert data.n_rows == 2 and next(data.batches()).rows[0] == {"q": "1", "a": "1"}


@pytest.mark.parametrize("value, message", [
    (None, "got null"), ("text", "got a string"), ([{"role": "user", "text": "hi"}], "message 0: has no 'content'"),
    ([{"role": "user", "content": None}], "message 0: 'content' must be a string, got null"),
    ([{"role": "", "content": "x"}], "message 0: 'role' must be a non-empty string"),
    ([{"role": "user", "content": "x"}, 3], "message 1: must be an object"),
])
def test_messages_are_checked_before_ray_and_when_rendered(tmp_path, tiny_path, value, message):
    """load_task (before Ray) refuses them naming file:line; render_prompts names the sample if one slips by."""
    from transformers import AutoTokenizer

    good = json.dumps({"msgs": [{"role": "user", "content": "hello"}], "a": "x"})
    spec, task = make(tmp_path, [good, json.dumps({"msgs": value, "a": "x"})], prompt=None, messages="msgs")
    with pytest.raises(DataError) as err:
        load_task(spec, task)
    assert str(err.value).startswith(f"{tmp_path / 'd.jsonl'}:2: column 'msgs' (tasks.t.messages) ")
    assert message in str(err.value)
    if value is None or isinstance(value, str):
        from cluster.inputs.data import RowBatch

        batch = RowBatch(["0", "1"], [json.loads(good), {"msgs": value, "a": "x"}], ["1", "2"])
        with pytest.raises(DataError, match="d.jsonl: sample 1: chat template failed"):
            render_prompts(task, batch, AutoTokenizer.from_pretrained(tiny_path), str(tmp_path / "d.jsonl"))


def test_nulls_in_parquet_columns_are_refused(tmp_path):
    pq.write_table(pa.table({"q": ["x", None], "a": ["1", "2"]}), tmp_path / "d.parquet")
    spec, task = make(tmp_path, [], data="d.parquet")
    with pytest.raises(DataError, match=r"d.parquet:row 1: column 'q' is null \(the task 't' needs a value as its "
                                        r"prompt placeholder \{q\}\)"):
        load_task(spec, task)


def test_a_model_that_fails_after_the_checks_names_the_spec_and_the_whole_reason(tmp_path, tiny_path, monkeypatch):
    """What find_model cannot see fails while loading: one line with the spec file and transformers' whole
    sentence, which it breaks over lines ("... from one of: \\n(1) ...")."""
    import shutil

    from cluster.contracts.errors import PreflightError
    from cluster.plan.plan_source import load_model_meta

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "m").mkdir()
    shutil.copy(f"{tiny_path}/config.json", tmp_path / "m")
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")  # passes find_model; no tokenizer in it
    with pytest.raises(PreflightError) as err:
        load_model_meta(ModelSpec("m", "./m"), str(tmp_path / "m"), "sweep.yaml")
    text = str(err.value)
    assert text.startswith("sweep.yaml: model m: cannot load './m': ") and "\n" not in text
    if "Couldn't instantiate the backend tokenizer" in text:
        assert "from one of: (1) a `tokenizers` library serialization file, (2)" in text


def loglik(tmp_path, rows: list[dict]):
    """A `type: loglikelihood` task over these rows: the context is `q`, the choices `c`, the target `a`."""
    return make(tmp_path, [json.dumps(r) for r in rows], prompt="{q}", type="loglikelihood", choices="c")


def test_an_empty_context_is_the_prefix_token_as_lm_eval_has_it(tmp_path, tiny_path):
    """lm-eval (v0.4.13, TemplateLM.loglikelihood, prefix_token_id): a context of "" becomes [BOS] (EOS where
    there is no BOS) and each choice its own tokens, no special tokens added; planning measures the same."""
    from transformers import AutoTokenizer

    from cluster.contracts.loglikelihood import encode_pairs

    tok = AutoTokenizer.from_pretrained(tiny_path)
    alone = [tok.encode(c, add_special_tokens=False) for c in ("yes", " no")]
    assert encode_pairs(["", "Q:"], [["yes", " no"], [" a"]], tok, True)[0] == ([tok.bos_token_id], alone)
    spec, task = loglik(tmp_path, [{"q": "", "c": ["yes", " no"], "a": 0}, {"q": "Q:", "c": [" a"], "a": 0}])
    plan = plan_task(spec.models[0], load_task(spec, task), tok, None, ShardLimits())
    lengths = {r["sample_id"]: r["prompt_tokens"] for s in plan.shards for r in s.rows.to_pylist()}
    # the default target_delimiter " " goes before each choice: " yes" (4 bytes), "Q:" + "  a"
    assert lengths == {"0": 1 + 4, "1": 2 + 3}
    tok.bos_token = None  # Qwen's tokenizers have none: lm-eval's prefix is then EOS
    assert encode_pairs([""], [["yes", " no"]], tok, True) == [([tok.eos_token_id], alone)]


def zero_token_choice_tokenizer():
    """A BPE whose merges make "hel" + "lo" one token ("hello"): the choice "lo" after "hel" is 0 tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate("helo")} | {"he": 4, "hel": 5, "hell": 6, "hello": 7}
    bpe = models.BPE(vocab=vocab, merges=[("h", "e"), ("he", "l"), ("hel", "l"), ("hell", "o")])
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe))


@pytest.mark.parametrize("rows, tokenizer, message", [
    ([{"q": "Q:", "c": [" a"], "a": 0}, {"q": "  ", "c": ["a"], "a": 0}], "tiny",
     "d.jsonl:2: tasks.t.prompt renders '  ', a context of 0 tokens for model m once its trailing whitespace moves "
     "to the choices (as lm-eval splits them): give it some text, or render it as \"\" (then BOS or EOS stands "
     "for it)"),
    ([{"q": "", "c": ["a"], "a": 0}], "tiny without BOS or EOS",
     "d.jsonl:1: tasks.t.prompt renders an empty context, which lm-eval replaces with the BOS or EOS token, and "
     "model m's tokenizer has neither"),
    ([{"q": "hel", "c": ["o", "lo"], "a": 0}], "merging",
     "d.jsonl:1: tasks.t.choices: choice 1 ('lo') is 0 tokens after the context 'hel' for model m (its tokenizer "
     "merges the choice into the context's end): it leaves nothing to score"),
])
def test_a_context_or_a_choice_of_0_tokens_is_refused_in_planning(tmp_path, tiny_path, rows, tokenizer, message):
    """The engine refuses both (actors/engine.py: check_loglik_requests), as lm-eval asserts; planning says
    so first, naming the file and line, instead of a shard failing at the engine, bisected, then FAILED."""
    from transformers import AutoTokenizer

    tok = zero_token_choice_tokenizer() if tokenizer == "merging" else AutoTokenizer.from_pretrained(tiny_path)
    if tokenizer == "tiny without BOS or EOS":
        tok.bos_token = tok.eos_token = None
    spec, task = loglik(tmp_path, rows)
    with pytest.raises(PreflightError) as err:
        plan_task(spec.models[0], load_task(spec, task), tok, None, ShardLimits())
    assert str(err.value) == f"{tmp_path}/{message}"


def test_raysweep_plan_says_a_0_token_context_in_one_line(tmp_path, capsys, tiny_path):  # built: no build line
    from jobs.cli import main

    (tmp_path / "d.jsonl").write_text(json.dumps({"q": " ", "c": ["a", "b"], "a": 1}) + "\n")
    (tmp_path / "s.yaml").write_text("name: s\nmodels: [{name: tiny, path: 'builtin:tiny'}]\ntasks:\n"
                                     "  - {name: mc, type: loglikelihood, data: d.jsonl, prompt: '{q}', choices: c, "
                                     "target: a}\n")
    assert main(["plan", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raysweep: error: {tmp_path}/d.jsonl:1: tasks.mc.prompt renders ' ', a context of 0 "
                          "tokens for model tiny") and len(err.splitlines()) == 1


def test_a_sweep_with_loglikelihood_tasks_marks_its_models_and_keeps_its_hash(tmp_path):
    """Their engines keep vLLM's compiled default (actors/vllm_args.py UNCOMPILED); the mark is derived from the
    tasks, so a spec's hash is the same with it or without."""
    from cluster.inputs.spec_file import parse_spec

    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "Q", "c": ["a", "b"], "a": 1}) + "\n")
    models = [{"name": "a", "path": "builtin:tiny"}, {"name": "b", "path": "builtin:tiny"}]
    generate = {"name": "g", "data": "d.jsonl", "prompt": "{q}"}
    choose = {"name": "mc", "type": "loglikelihood", "data": "d.jsonl", "prompt": "{q}", "choices": "c", "target": "a"}
    mixed = parse_spec({"name": "s", "models": models, "tasks": [generate, choose]}, base_dir=str(tmp_path))
    alone = parse_spec({"name": "s", "models": models, "tasks": [generate]}, base_dir=str(tmp_path))
    assert [m.loglikelihood for m in mixed.models] == [True, True]
    assert [m.loglikelihood for m in alone.models] == [False, False]
    unmarked = dataclasses.replace(mixed, models=alone.models)
    assert unmarked.digest() == mixed.digest() and unmarked.digest(with_placement=True) == \
        mixed.digest(with_placement=True)


def test_an_output_made_before_target_delimiter_goes_on_without_one(tmp_path):
    """Outputs made before loglikelihood tasks had a target_delimiter were made with none: their manifest has
    no marker, and their tasks that leave the setting out go on with "" (the spec hash is the same)."""
    from cluster.store.manifest import DELIMITER_DEFAULT, as_made, fresh_manifest

    spec, task = loglik(tmp_path, [{"q": "Q:", "c": ["a", "b"], "a": 0}])
    assert task.delimiter == " " and task.target_delimiter is None
    made_now = fresh_manifest(spec, {}, spec.digest())
    assert made_now[DELIMITER_DEFAULT] == " " and as_made(spec, made_now) is spec
    made_before = {k: v for k, v in made_now.items() if k != DELIMITER_DEFAULT}
    old = as_made(spec, made_before)
    assert [t.delimiter for t in old.tasks] == [""] and old.digest() != spec.digest()  # "" said: hashed
    assert spec.digest() == dataclasses.replace(spec, tasks=(dataclasses.replace(task, target_delimiter=None),)).digest()


@pytest.mark.parametrize("named", [None, "TokenizersBackend", "GPT2TokenizerFast", "LlamaTokenizerFast"])
def test_the_drivers_tokenizer_is_autotokenizers_without_torch(model_cache, tmp_path, named):
    """cluster/inputs/model_files.py: the tokenizer the driver loads encodes (with and without special tokens,
    chat template included) as AutoTokenizer's does, and the context length is AutoConfig's. Where
    tokenizer_config.json names the generic fast tokenizer (the builtin models' PreTrainedTokenizerFast, None
    here), the driver's model checks leave torch unimported in a fresh process (its import took 9.8 of a 10.7 s
    plan); a model-specific class goes through AutoTokenizer (it loads the generic class for a
    LlamaTokenizerFast with a byte-level tokenizer.json)."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoConfig, AutoTokenizer

    from tests.conftest import ROOT

    from cluster.inputs.builtin_model import resolve_model_path
    from cluster.inputs.model_files import context_length, load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny"), folder)
    if named is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = named
        config["add_bos_token"] = named == "LlamaTokenizerFast"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    texts = ["Question: 2 + 2?\nAnswer:", "  leading spaces and ünïcödé 한국어", ""]
    ours, auto = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    for special in (True, False):
        assert ours(texts, add_special_tokens=special)["input_ids"] == auto(texts, add_special_tokens=special)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert context_length(str(folder)) == AutoConfig.from_pretrained(str(folder)).max_position_embeddings
    probe = ("import sys\nfrom cluster.contracts.spec import ModelSpec\nfrom cluster.plan.plan_source import load_model_meta\n"
             f"load_model_meta(ModelSpec(name='m', path={str(folder)!r}), {str(folder)!r})\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    generic = named in (None, "TokenizersBackend")
    assert done.stdout.strip() == ("False" if generic else "True"), done.stderr[-2000:]


def test_a_config_without_a_named_context_length_gets_autoconfigs(model_cache, tmp_path):
    """config.json without max_position_embeddings or n_positions: the length is AutoConfig's (its default for
    the architecture, or its attribute map's name for it), as before the driver read config.json itself."""
    import shutil

    from transformers import AutoConfig

    from cluster.inputs.builtin_model import resolve_model_path
    from cluster.inputs.model_files import context_length

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny"), folder)
    config = json.loads((folder / "config.json").read_text())
    given = config.pop("max_position_embeddings")
    (folder / "config.json").write_text(json.dumps(config))
    expected = AutoConfig.from_pretrained(str(folder)).max_position_embeddings
    assert context_length(str(folder)) == expected and expected != given  # the architecture's default, not None


def test_planning_prompts_measured_before_loads_no_tokenizer_and_a_changed_tokenizer_is_measured_anew(tmp_path):
    """A warm pool's sweep planned the same prompts in seconds of importing transformers (and torch, where
    transformers imports it) only to find every count in the token cache. Each plan runs in a fresh process,
    as a sweep's driver does."""
    import os
    import shutil
    import subprocess
    import sys

    from cluster.inputs.builtin_model import resolve_model_path
    from tests.conftest import ROOT

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny"), folder)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "q": f"question {i} " * (i % 7 + 1)}) + "\n" for i in range(60)))
    spec = tmp_path / "sweep.yaml"
    spec.write_text(json.dumps({"name": "s", "output": str(tmp_path / "out"), "models": [{"name": "m", "path": str(folder)}],
                                "tasks": [{"name": "t", "data": str(data), "id_column": "id", "prompt": "Q: {q}\nA:",
                                           "sampling": {"max_tokens": 4}}]}))
    probe = ("import json, sys\nfrom cluster.inputs.spec_file import load_spec\nfrom cluster.plan.plan_source import plan_events\n"
             "from cluster.inputs.checks import check_inputs\n"
             f"spec = load_spec({str(spec)!r})\n"
             "plans = [e for e in plan_events(spec, check_inputs(spec).data) if hasattr(e, 'shards')]\n"
             "print(json.dumps(['transformers' in sys.modules, [p.lengths.tolist() for p in plans]]))")

    def plan() -> tuple[bool, list]:
        done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env=os.environ | {"RAYSWEEP_CACHE": str(tmp_path / "cache")})
        assert done.returncode == 0, done.stderr[-3000:]
        loaded, lengths = json.loads(done.stdout.strip().splitlines()[-1])
        return loaded, lengths

    first = plan()
    assert first[0] is True  # nothing measured yet: the tokenizer loads
    assert plan() == (False, first[1])  # every prompt measured before: no tokenizer, the same counts
    # the same tokenizer with one more special token in front of every prompt: other files, measured anew
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    bos = tokenizer["added_tokens"][0]
    tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}},
                                   {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                   {"Sequence": {"id": "B", "type_id": 1}}],
                                   "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    changed = plan()
    assert changed[0] is True and changed[1] != first[1]


def test_a_profile_is_an_enum_printed_and_stored_as_its_value():
    """Profiles were bare strings compared in five places; the enum keeps what the results, telemetry and lines
    hold ("short", not "Profile.SHORT")."""
    import pyarrow as pa

    from cluster.contracts.shard import LONG, SHORT, Profile

    assert (SHORT, LONG) == (Profile("short"), Profile("long")) and SHORT == "short"
    assert f"{SHORT}/{LONG}" == "short/long" and str(LONG) == "long"
    assert pa.array([SHORT, LONG]).to_pylist() == ["short", "long"]
