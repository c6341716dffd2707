"""A shard's rows through an engine (actors/shard_work.py): no row is committed `ok` without its engine's result."""

import pytest

from actors.engine import GenResult
from actors.shard_work import run_rows
from cluster.contracts.task_spec import SamplingSpec, TaskSpec


class FakeEngineThatDropsRequests:
    """A fake engine (the real ones cannot run here without a model) that answers only the first `answered`
    requests of a call, as an engine whose batching loop skipped some would."""

    def __init__(self, answered: int):
        self.answered = answered

    def generate(self, requests, sampling, structured):
        return [GenResult(r.sample_id, "out", 1, "stop", None, None) for r in requests[:self.answered]]


def rows(n: int) -> list[dict]:  # tokens carried (as for truncated rows): no tokenizer needed
    return [{"sample_id": f"s{i}", "prompt": "p", "status": "ok", "seed": i, "prompt_token_ids": [1, 2],
             "prompt_tokens": 2} for i in range(n)]


def no_tokenizer(prompts, add_special_tokens):  # asked for the ids of no prompt: every row carries its own
    assert not prompts
    return {"input_ids": []}


@pytest.mark.parametrize("answered", [0, 2])
def test_an_engine_that_answers_fewer_requests_than_it_was_asked_fails_the_call(answered):
    task = TaskSpec(name="t", data="d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=4))
    with pytest.raises(RuntimeError, match=f"the engine answered {answered} of 3 requests, not each one once"):
        run_rows(FakeEngineThatDropsRequests(answered), rows(3), task, tokenizer=no_tokenizer, add_special_tokens=True)


def test_an_engine_that_answers_every_request_gives_every_row_its_output():
    task = TaskSpec(name="t", data="d.jsonl", prompt="{q}", sampling=SamplingSpec(max_tokens=4))
    out = run_rows(FakeEngineThatDropsRequests(3), rows(3), task, tokenizer=no_tokenizer, add_special_tokens=True)
    assert [r["output_text"] for r in out.rows] == ["out"] * 3 and {r["status"] for r in out.rows} == {"ok"}
