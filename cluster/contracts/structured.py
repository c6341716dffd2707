"""Structured outputs: a task's `structured` spec as an xgrammar grammar, and checking an output against it.

The engines constrain generation with the grammar (token masks); `is_valid` checks the finished text
independently of that machinery — JSON Schema through `jsonschema`, choices by membership, regexes with
Python's `re`, EBNF grammars by feeding the text to a fresh xgrammar matcher.
"""

from __future__ import annotations

import functools
import json
import re

from cluster.contracts.spec import StructuredSpec

_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+?:\d+: ")  # "[11:01:53] /project/cpp/x.cc:820: "


def to_grammar(spec: StructuredSpec):
    """The xgrammar `Grammar` for a spec. JSON is compact (no free whitespace): a model that may emit
    whitespace between JSON tokens can do so until max_tokens and never close the object."""
    import xgrammar as xgr

    if spec.kind == "json_schema":
        return xgr.Grammar.from_json_schema(json.dumps(spec.value), any_whitespace=False)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.value))
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    return xgr.Grammar.from_ebnf(spec.value)


def check(spec: StructuredSpec) -> None:
    """Raise ValueError (naming the kind) if the spec is not valid. Cheap, for before Ray starts: JSON
    schemas by `jsonschema`, regexes by Python's `re`, EBNF grammars parsed by xgrammar with no tokenizer
    (importing xgrammar takes seconds: it loads torch, so only a grammar pays for it here). xgrammar's
    conversion of the others is checked when the planner compiles them for each model's tokenizer."""
    if spec.kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validators.validator_for(spec.value).check_schema(spec.value)
        except jsonschema.SchemaError as e:
            raise ValueError(f"json_schema: not a valid JSON schema: {e.message}") from None
    if spec.kind == "regex":
        try:
            re.compile(spec.value)
        except re.error as e:
            raise ValueError(f"regex: does not compile: {e}") from None
    if spec.kind == "grammar":
        try:
            to_grammar(spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            raise ValueError(f"grammar: xgrammar cannot parse it: {xgrammar_message(e)}") from None


def xgrammar_message(error: Exception) -> str:
    """xgrammar's message on one line, without the log prefix its C++ side adds: `[11:01:53]
    /project/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 16: ...` -> `EBNF parser error ...`."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    return "; ".join(line for line in lines if line) or type(error).__name__


def is_valid(spec: StructuredSpec, text: str) -> bool:
    if spec.kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), spec.value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.kind == "choice":
        return text in spec.value
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    return _grammar_accepts(spec.value, text)


def _grammar_accepts(ebnf: str, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(_text_compiler().compile_grammar(ebnf), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


@functools.lru_cache(maxsize=1)
def _text_compiler():
    """A compiler over an empty vocabulary: enough to match strings, with no model's tokenizer."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1)
