"""Scorers: one output and its target in, a score in [0, 1] out (None where the row was not generated).

Each scorer is a plain function `score(output, target, args) -> float`; `SCORERS` maps the spec's names
to them. Targets arrive as read from the data file (a string, a number, or a parsed JSON value). A scorer
in `METRICS` also gives each completion other metrics by name (numeric_match: both of its extractions), which
the driver keeps in the results' `metrics` column and the summary averages as it does `score`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from cluster.contracts.spec import ScorerSpec, TaskSpec

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# numeric_match's strict markers, each with its one space, as lm-eval's strict-match patterns have them:
# GSM8K's answer format (`#### 18`, lm-eval gsm8k's) and lm-eval gsm8k-cot's ("The answer is 18.")
_MARKED = re.compile(r"(?:#### |The answer is )(" + _NUMBER.pattern + ")")


def exact_match(output: str, target: Any, args: dict) -> float:
    return float(output.strip() == _text(target).strip())


def numeric_match(output: str, target: Any, args: dict) -> float:
    r"""The output's number equals the target's (commas ignored, 1e-6 relative tolerance); 0 where the output
    has none. A number is `-?\d[\d,]*(\.\d+)?` or `-?\.\d+`; where it is found, by `extract`:
    - `flexible` (the default; lm-eval's flexible-extract): the last number anywhere in the output;
    - `strict` (lm-eval's strict-match): the number right after `#### ` or `The answer is ` (case and the one
      space as written), at the first such place in the output; with `pattern`, the first number in the
      pattern's group, at the pattern's first match."""
    got = _strict_number(output, args.get("pattern")) if args.get("extract") == "strict" else _last_number(output)
    want = _to_number(_text(target))
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def numeric_metrics(output: str, target: Any, args: dict) -> list[dict]:
    """Both of numeric_match's extractions as metrics, as lm-eval reports GSM8K's (the results' `metrics`)."""
    return [{"name": "flexible_extract", "value": numeric_match(output, target, {"extract": "flexible"})},
            {"name": "strict_match", "value": numeric_match(output, target, {**args, "extract": "strict"})}]


def _last_number(output: str) -> float | None:
    found = _NUMBER.findall(output)
    return _to_number(found[-1]) if found else None


def _strict_number(output: str, pattern: str | None) -> float | None:
    if pattern is None:
        marked = _MARKED.search(output)
        return _to_number(marked.group(1)) if marked else None
    match = re.search(pattern, output)
    number = _NUMBER.search(match.group(1) or "") if match else None
    return _to_number(number.group()) if number else None


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


# per scorer, the metrics each completion gets beside its score (the results' `metrics`; the summary's means)
METRICS: dict[str, Callable[[str, Any, dict], list[dict]]] = {"numeric_match": numeric_metrics}


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


def metrics_for(task: TaskSpec) -> Callable[[str, Any], list[dict]] | None:
    """The task's per-completion metrics beside its score ([{name, value}, ...]), its arguments bound; None
    where its scorer has none."""
    fn = METRICS.get(task.scorer.name) if task.scorer is not None else None
    if fn is None:
        return None
    args = dict(task.scorer.args)
    return lambda output, target: fn(output, target, args)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None
