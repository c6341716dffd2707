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
