"""The CPU engine: deterministic greedy decoding, per-sample seeds, stop strings, and grammar-constrained
structured outputs that always parse (masks during generation, checked independently afterwards)."""

import json

import jsonschema
import pytest

from actors.engine import GenRequest
from cluster.contracts.spec import SamplingSpec, StructuredSpec
from cluster.contracts.structured import is_valid

PROMPTS = ["Question: What is 2 + 2?\nAnswer:", "Hi", "A much longer prompt, so that the batch needs left padding."]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def requests(engine, prompts, seeds=None):
    seeds = seeds or range(len(prompts))
    return [GenRequest(str(i), engine.tokenizer(p)["input_ids"], s) for i, (p, s) in enumerate(zip(prompts, seeds))]


def test_greedy_is_deterministic_and_batch_independent(hf_engine):
    sampling = SamplingSpec(max_tokens=12)
    first = hf_engine.generate(requests(hf_engine, PROMPTS), sampling, None)
    again = hf_engine.generate(requests(hf_engine, PROMPTS), sampling, None)
    assert [r.output_text for r in first] == [r.output_text for r in again]
    alone = [hf_engine.generate(requests(hf_engine, [p]), sampling, None)[0] for p in PROMPTS]
    assert [r.output_text for r in alone] == [r.output_text for r in first]  # left padding changes nothing
    assert all(r.output_tokens == 12 and r.finish_reason == "length" for r in first)
    assert all(0 < r.ttft_s <= r.latency_s for r in first)


def test_sampling_follows_per_sample_seeds(hf_engine):
    sampling = SamplingSpec(max_tokens=16, temperature=1.0)
    a = hf_engine.generate(requests(hf_engine, ["Hi"] * 4, seeds=[1, 1, 2, 3]), sampling, None)
    b = hf_engine.generate(requests(hf_engine, ["Hi"] * 4, seeds=[1, 1, 2, 3]), sampling, None)
    texts = [r.output_text for r in a]
    assert texts == [r.output_text for r in b]
    assert texts[0] == texts[1] and len({texts[1], texts[2], texts[3]}) == 3


def test_a_temperature_too_small_to_divide_by_samples_as_vllm_does_at_its_floor(hf_engine):
    """1e-45 divides the logits into inf (every probability NaN: the sampler raised); vLLM raises a temperature
    under 0.01 to 0.01, and so does the CPU engine."""
    tiny = hf_engine.generate(requests(hf_engine, PROMPTS), SamplingSpec(max_tokens=8, temperature=1e-45), None)
    floor = hf_engine.generate(requests(hf_engine, PROMPTS), SamplingSpec(max_tokens=8, temperature=0.01), None)
    assert [r.output_text for r in tiny] == [r.output_text for r in floor]
    assert all(r.output_tokens == 8 for r in tiny)


def test_stop_string_ends_output_before_it(hf_engine):
    free = hf_engine.generate(requests(hf_engine, PROMPTS), SamplingSpec(max_tokens=40, temperature=1.0), None)
    stop = free[0].output_text[5:7]  # a string this exact generation produces
    cut = hf_engine.generate(requests(hf_engine, PROMPTS[:1]),
                             SamplingSpec(max_tokens=40, temperature=1.0, stop=(stop,)), None)[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.output_text and free[0].output_text.startswith(cut.output_text)
    assert cut.output_tokens < 40


def test_a_stop_string_in_a_special_tokens_text_stops_a_row_as_lm_evals_hf_model_does(hf_engine):
    """A model that emits `<|reserved_1|>` under `until: ["e"]`: lm-eval's `--model hf` stops (its criteria decode
    the last tokens with their special tokens, and "e" is in the token's text) and returns the text before it;
    the CPU engine ran on to max_tokens (gsm8k's `until` holds "<|im_end|>" and "</s>", special tokens' texts).
    Decided here token by token against lm-eval's own criteria on the same tokens."""
    import torch
    from lm_eval.models.utils_hf import MultiTokenEOSCriteria

    from actors.hf_engine import _Row

    tok = hf_engine.tokenizer
    special = tok.convert_tokens_to_ids("<|reserved_1|>")
    generated = tok.encode("abc", add_special_tokens=False) + [special] + tok.encode("xyz", add_special_tokens=False)
    sampling = SamplingSpec(max_tokens=40, stop=("e",))
    row = _Row()
    for k, token in enumerate(generated):
        hf_engine._advance(row, token, None, sampling, now=float(k))
        criteria = MultiTokenEOSCriteria("e", tok, 0, 1)
        criteria(torch.tensor([generated[:k + 1]]), None)
        assert (row.finish == "stop") == criteria.done_tracker[0], k
        if row.finish:
            break
    assert row.finish == "stop" and row.text == "abc" and len(row.tokens) == 4
    # a stop string in the text itself still cuts the text before it
    row = _Row()
    for k, token in enumerate(tok.encode("abcxez", add_special_tokens=False)):
        hf_engine._advance(row, token, None, sampling, now=float(k))
    assert row.finish == "stop" and row.text == "abcx"


@pytest.mark.parametrize("spec, check", [
    (StructuredSpec("json_schema", PERSON), lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    (StructuredSpec("choice", ("yes", "no", "maybe")), lambda text: text in ("yes", "no", "maybe")),
    (StructuredSpec("regex", r"[0-9]{3}-[A-Z]{2}"), lambda text: len(text) == 6 and text[3] == "-"),
    (StructuredSpec("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
     lambda text: text.startswith("(") and text.endswith(")")),
])
def test_structured_outputs_always_valid(hf_engine, spec, check):
    """64 sampled generations (temperature 1, distinct seeds) all finish inside the grammar."""
    reqs = requests(hf_engine, ["Answer:"] * 64, seeds=range(100, 164))
    out = hf_engine.generate(reqs, SamplingSpec(max_tokens=64, temperature=1.0), spec)
    texts = [r.output_text for r in out]
    assert all(r.finish_reason == "stop" for r in out), [r.output_text for r in out if r.finish_reason != "stop"]
    assert all(is_valid(spec, t) and check(t) for t in texts), texts
    assert len(set(texts)) > 1  # sampling really varied the outputs


def test_validity_checker_rejects_what_the_grammar_would_not_allow():
    assert not is_valid(StructuredSpec("json_schema", PERSON), '{"name": "bob", "age": 3}')
    assert not is_valid(StructuredSpec("json_schema", PERSON), '{"name": "Bob"')
    assert not is_valid(StructuredSpec("choice", ("yes", "no")), "yes ")
    assert not is_valid(StructuredSpec("regex", r"[0-9]+"), "12a")
    assert not is_valid(StructuredSpec("grammar", 'root ::= "a" "b"*'), "abba")
    assert is_valid(StructuredSpec("grammar", 'root ::= "a" "b"*'), "abbb")
