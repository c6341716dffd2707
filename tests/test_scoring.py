"""Scorers against hand-worked cases."""

import pytest

from cluster.score.scorers import SCORERS, scorer_for
from cluster.contracts.spec import ScorerSpec, StructuredSpec, TaskSpec


@pytest.mark.parametrize("name, output, target, args, expected", [
    ("exact_match", " Paris\n", "Paris", {}, 1.0),
    ("exact_match", "paris", "Paris", {}, 0.0),
    ("numeric_match", "So 12 + 30 = 42.", "42", {}, 1.0),
    ("numeric_match", "It is 1,234.50 dollars", 1234.5, {}, 1.0),
    ("numeric_match", "-7", "-7", {}, 1.0),
    ("numeric_match", "42 or 43", "42", {}, 0.0),
    ("numeric_match", "no digits", "1", {}, 0.0),
    ("choice", "B. otter", "B", {"choices": ["A", "B", "C", "D"]}, 1.0),
    ("choice", "C", "B", {"choices": ["A", "B", "C", "D"]}, 0.0),
    ("choice", "(B) because", "B", {}, 1.0),
    ("json_match", '{"a": 1, "b": [2]}', {"b": [2], "a": 1}, {}, 1.0),
    ("json_match", '{"a": 1, "b": 3}', '{"a": 1, "b": 2}', {"fields": ["a"]}, 1.0),
    ("json_match", '{"a": 1, "b": 3}', '{"a": 1, "b": 2}', {"fields": ["a", "b"]}, 0.0),
    ("json_match", '{"a": 1', '{"a": 1}', {}, 0.0),
    ("regex_match", "The answer is: 17 apples", "17", {"pattern": r"answer is: (\d+)"}, 1.0),
    ("regex_match", "nothing here", "17", {"pattern": r"answer is: (\d+)"}, 0.0),
])
def test_scorers(name, output, target, args, expected):
    assert SCORERS[name](output, target, args) == expected


def test_choice_scorer_takes_choices_from_structured():
    task = TaskSpec(name="t", data="d.jsonl", prompt="{q}", target="a", scorer=ScorerSpec("choice"),
                    structured=StructuredSpec("choice", ("yes", "no")))
    assert scorer_for(task)("no", "no") == 1.0 and scorer_for(task)("yes", "no") == 0.0


# numeric_match's two extractions: (completion, target, strict, flexible)
NUMERIC_TABLE = [
    ("R\ufffdH\ufffdH9vH", 9, 0.0, 1.0),  # garbage with a digit in it: only the flexible extraction finds it
    ("#### 1,234", 1234, 1.0, 1.0),
    ("#### 1,234.", "1234", 1.0, 1.0),
    ("The answer is 42.", 42, 1.0, 1.0),
    ("The answer is 1,000,000.", 1000000, 1.0, 1.0),
    ("12 + 30 = 42. The answer is 42.", "42", 1.0, 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72, 1.0, 1.0),
    ("The answer is -5.", -5, 1.0, 1.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("-12", -12, 0.0, 1.0),
    ("#### 2.5", 2.5, 1.0, 1.0),
    ("#### -0.5", "-0.5", 1.0, 1.0),
    ("The answer is 0.75 of the cake", "0.75", 1.0, 1.0),
    ("#### 18 dollars, and 20 next week", 18, 1.0, 0.0),  # the number after the marker, more text after it
    ("#### 7\nQuestion: Tom has 9 pens.\n#### 9", 7, 1.0, 0.0),  # strict: the first marker; flexible: the last number
    ("She has 5 apples, so the answer is 7", 7, 0.0, 1.0),  # "the answer is": not the marker's case
    ("The answer is: 5", 5, 0.0, 1.0),  # something between the marker and the number
    ("####5", 5, 0.0, 1.0),  # the marker's space missing
    ("The answer is $18.", 18, 0.0, 1.0),
    ("2 + 2 = 4", 4, 0.0, 1.0),
    ("no number at all", 3, 0.0, 0.0),
    ("The answer is", 3, 0.0, 0.0),
    ("#### ", 3, 0.0, 0.0),
    # where raysweep and lm-eval's GSM8K differ (NUMERIC_NOT_LM_EVAL)
    ("3.0", 3, 0.0, 1.0),
    ("1,234.50 dollars", 1234.5, 0.0, 1.0),
    ("-.5", -0.5, 0.0, 1.0),
    ("The answer is 42", 42, 1.0, 1.0),
]
# raysweep compares numbers, lm-eval's exact_match compares text ("3.0" is not "3"); lm-eval gsm8k-cot's
# strict pattern wants one character after the number, so it takes "4" from a final "The answer is 42"
NUMERIC_NOT_LM_EVAL = {"3.0", "1,234.50 dollars", "-.5", "The answer is 42"}


@pytest.mark.parametrize("output, target, strict, flexible", NUMERIC_TABLE)
def test_numeric_match_strict_and_flexible(output, target, strict, flexible):
    from cluster.score.scorers import numeric_metrics

    assert SCORERS["numeric_match"](output, target, {"extract": "strict"}) == strict
    assert SCORERS["numeric_match"](output, target, {"extract": "flexible"}) == flexible
    assert SCORERS["numeric_match"](output, target, {}) == flexible  # the default: today's
    assert numeric_metrics(output, target, {}) == [{"name": "flexible_extract", "value": flexible},
                                                   {"name": "strict_match", "value": strict}]


def test_numeric_match_agrees_with_lm_evals_gsm8k_filters_and_exact_match():
    """lm-eval's own filters (gsm8k's strict-match, else gsm8k-cot's; flexible-extract) and exact_match with
    gsm8k's regexes_to_ignore, on the table: the same scores, except where NUMERIC_NOT_LM_EVAL says why not."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    strict = [RegexFilter(r"#### (\-?[0-9\.\,]+)"), RegexFilter(r"The answer is (\-?[0-9\.\,]+).")]
    flexible = RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)

    def lm_eval(output, target):
        picked = [f.apply([[output]], [{}])[0][0] for f in strict]
        scores = []
        for got in (next((p for p in picked if p != "[invalid]"), "[invalid]"), flexible.apply([[output]], [{}])[0][0]):
            scores.append(float(exact_match_hf_evaluate([got], [str(target)], ignore_case=True,
                                                        regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"])["exact_match"]))
        return tuple(scores)

    for output, target, want_strict, want_flexible in NUMERIC_TABLE:
        same = lm_eval(output, target) == (want_strict, want_flexible)
        assert same == (output not in NUMERIC_NOT_LM_EVAL), (output, lm_eval(output, target))


def test_numeric_match_with_a_pattern_takes_the_first_number_in_its_group():
    score = SCORERS["numeric_match"]
    args = {"extract": "strict", "pattern": r"Answer: (.*)"}
    assert score("Work: 3 + 4\nAnswer: about 7 apples, not 8", 7, args) == 1.0
    assert score("Answer: seven\nAnswer: 7", 7, args) == 0.0  # the pattern's first match holds no number
    assert score("#### 7", 7, args) == 0.0  # the pattern replaces the markers
    assert score("Answer: -1,500.5", -1500.5, args) == 1.0


@pytest.mark.parametrize("args, message", [
    ({"extract": "loose"}, "extract: must be one of flexible, strict, got 'loose'"),
    ({"pattern": r"A: (\d+)"}, "pattern: numeric_match reads a `pattern` only with `extract: strict` "
                               "(flexible takes the last number)"),
    ({"extract": "strict", "pattern": r"A: \d+"}, "pattern: must have exactly one group, around the answer "
                                                  "(e.g. 'Answer: (-?[0-9.,]+)'), has 0"),
    ({"extract": "strict", "pattern": r"A: ("}, "pattern: does not compile: missing ), unterminated subpattern at "
                                                "position 3"),
    ({"extract": "strict", "pattern": 5}, "pattern: must be a regular expression (a string), got 5"),
    ({"extracts": "strict"}, "extracts: not an argument of scorer numeric_match (did you mean 'extract'?)"),
])
def test_numeric_match_arguments_are_checked_with_one_line_naming_the_field(args, message):
    with pytest.raises(ValueError) as err:
        ScorerSpec("numeric_match", args)
    assert str(err.value) == message


def test_a_numeric_match_scorer_in_yaml_names_the_file_and_field(tmp_path):
    from cluster.contracts.spec import SpecError
    from cluster.inputs.spec_file import load_spec
    from tests.conftest import replay_spec

    spec = replay_spec(tmp_path, "s", [], scorer="{name: numeric_match, extract: strict}")
    assert load_spec(spec).tasks[0].scorer == ScorerSpec("numeric_match", {"extract": "strict"})
    spec = replay_spec(tmp_path, "s", [], scorer="{name: numeric_match, extract: strct}")
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert str(err.value) == f"{spec}: tasks[0].scorer.extract: must be one of flexible, strict, got 'strct'"


def test_the_default_numeric_match_spec_is_the_one_before_extract_existed():
    """`scorer: numeric_match` keeps its arguments empty: existing specs hash as before."""
    from cluster.score.scorers import metrics_for

    task = TaskSpec(name="t", data="d.jsonl", prompt="{q}", target="a", scorer=ScorerSpec("numeric_match"))
    assert task.scorer.args == {}
    assert metrics_for(task)("#### 4, so 5", 4) == [{"name": "flexible_extract", "value": 0.0},
                                                     {"name": "strict_match", "value": 1.0}]
    assert metrics_for(TaskSpec(name="t", data="d.jsonl", prompt="{q}", target="a",
                                scorer=ScorerSpec("exact_match"))) is None
