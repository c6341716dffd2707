"""Scorers: one output and its target in, a score in [0, 1] out (None where the row was not generated).

Each scorer is a plain function `score(output, target, args) -> float`; `SCORERS` maps the spec's names
to them. Targets arrive as read from the data file (a string, a number, or a parsed JSON value).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from cluster.contracts.spec import ScorerSpec, TaskSpec

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(output: str, target: Any, args: dict) -> float:
    return float(output.strip() == _text(target).strip())


def numeric_match(output: str, target: Any, args: dict) -> float:
    """The last number in the output equals the target number (commas ignored, 1e-6 relative tolerance)."""
    found = _NUMBER.findall(output)
    want = _to_number(_text(target))
    if not found or want is None:
        return 0.0
    got = _to_number(found[-1])
    return float(got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def choice(output: str, target: Any, args: dict) -> float:
    """The choice the output starts with (longest first) equals the target; with no `choices` given,
    the first whitespace-separated word, stripped of punctuation, is taken."""
    text = output.strip()
    options = sorted(args.get("choices") or (), key=len, reverse=True)
    picked = next((c for c in options if text.startswith(c)), None)
    if picked is None and not options:
        picked = text.split()[0].strip(".,:;)(") if text.split() else None
    return float(picked is not None and picked == _text(target).strip())


def json_match(output: str, target: Any, args: dict) -> float:
    """Parsed output equals the parsed target, or, with `fields`, agrees on each listed field."""
    try:
        got = json.loads(output)
    except ValueError:
        return 0.0
    want = json.loads(target) if isinstance(target, str) else target
    fields = args.get("fields")
    if not fields:
        return float(got == want)
    if not isinstance(got, dict) or not isinstance(want, dict):
        return 0.0
    return float(all(f in got and got.get(f) == want.get(f) for f in fields))


def regex_match(output: str, target: Any, args: dict) -> float:
    """The first match of `pattern` in the output (its `group`, default 1 if the pattern has groups)
    equals the target."""
    m = re.search(args["pattern"], output)
    if m is None:
        return 0.0
    group = args.get("group", 1 if m.re.groups else 0)
    return float((m.group(group) or "").strip() == _text(target).strip())


SCORERS: dict[str, Callable[[str, Any, dict], float]] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "choice": choice,
    "json_match": json_match, "regex_match": regex_match,
}


def scorer_for(task: TaskSpec) -> Callable[[str, Any], float] | None:
    """The task's scorer with its arguments bound; a `choice` scorer defaults to the structured choices."""
    spec: ScorerSpec | None = task.scorer
    if spec is None:
        return None
    args = dict(spec.args)
    if spec.name == "choice" and "choices" not in args and task.structured and task.structured.kind == "choice":
        args["choices"] = list(task.structured.value)
    fn = SCORERS[spec.name]
    return lambda output, target: fn(output, target, args)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None
