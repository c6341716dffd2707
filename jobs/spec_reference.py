"""`raysweep spec-reference`: the sweep spec's reference in Markdown, generated from cluster/contracts/spec.py so it
cannot drift from the code. sweeps/REFERENCE.md is its committed output (a test checks the two agree).

Everything is read from the code:
1. sections and their order: the dataclasses reached from `SweepSpec` through the fields' types;
2. each field's type and default: the dataclass field (a default the loader fills in, such as `output`,
   by loading a minimal spec);
3. allowed values: the constants `__post_init__` tests a field against (`self.x not in SCORERS`) and the
   name pattern (`_check_name`, `NAME_RE.match`);
4. checks: the `ValueError` messages `__post_init__` raises, by the field they name;
5. what a field means: the comments beside and above it;
6. whether a field is a YAML key at all, or is spelt under another key (`engine.backend`): by loading a
   minimal spec with the key added.
Only the YAML shape of the two sections that are not plain mappings (structured, scorer) and the `engine:`
shorthand are written here.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import re
import tempfile
import textwrap
import tokenize
import typing
from pathlib import Path
from types import NoneType, UnionType

from cluster.contracts import spec as S
from cluster.contracts.model_paths import BUILTIN_PREFIX
from cluster.inputs.builtin_model import CONFIGS as BUILTIN_MODELS
from cluster.inputs.spec_file import parse_spec

# cluster/contracts/spec.py's _structured and _scorer: the two sections whose YAML is not a mapping of their fields
SHAPES = {
    "StructuredSpec": "In YAML one key, the kind, holding the value: `structured: {choice: [A, B, C, D]}`, "
                      "`structured: {json_schema: {...}}`, `structured: {regex: '...'}`, `structured: {grammar: '...'}`.",
    "ScorerSpec": "In YAML a scorer name (`scorer: exact_match`) or a mapping of `name` and the scorer's "
                  "arguments (`scorer: {name: json_match, fields: [name, age]}`).",
    "LmEvalSettings": "A task entry of its own, `- lm_eval: {tasks: [arc_easy], num_fewshot: 2}`, beside or instead of "
                      "the tasks above: each lm-eval task it names becomes a raysweep task of that name, its requests "
                      "built and its results scored by lm-eval (docs/lm-eval.md; needs `pip install 'raysweep[lm-eval]'`).",
}
# sections reached through a field the YAML does not spell that way: (YAML path, the dataclass to show there)
ENTRIES = {"LmEvalTask": ("tasks[].lm_eval", "LmEvalSettings")}
# cluster/contracts/spec.py's _model: a shorthand the loader reads
NOTES = {"ModelSpec": "`engine: NAME` is short for `engine: {backend: NAME}`; every other `engine` key goes to the "
                      "engine as is (vLLM's or transformers' own arguments). `tensor_parallel_size` and "
                      "`pipeline_parallel_size` (integers from 1 to 16) also place the model: each of its actors "
                      "holds their product of whole GPUs, on one node. `path: builtin:NAME` names a model raysweep "
                      "builds locally, with random weights and no download: "
                      + ", ".join(f"`{BUILTIN_PREFIX}{name}`" for name in BUILTIN_MODELS)
                      + " (`raysweep models` lists their sizes)."}
# the code's comments cite docs/design.md (`(docs/design.md, Planning)`): the spec reference leaves those out
DOC_CITATION = re.compile(r" ?\(docs/design\.md, [^)]*\)")
MINIMAL = {"name": "NAME", "models": [{"name": "m", "path": "builtin:tiny"}],
           "tasks": [{"name": "t", "data": "data.jsonl", "prompt": "{q}"}]}


def render() -> str:
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "data.jsonl").write_text('{"q": "1"}\n')
        probe = _Probe(folder)
        parts = [_header()]
        for path, cls in sections():
            parts.append(_section(path, cls, probe))
    return "\n".join(parts)


def _header() -> str:
    return textwrap.dedent("""\
        # Sweep spec reference

        <!-- Generated from cluster/contracts/spec.py by jobs/spec_reference.py; do not edit. Regenerate with
             `raysweep spec-reference > sweeps/REFERENCE.md` (tests/test_report.py checks it is current). -->

        A sweep spec is one YAML file ([docs/spec.md](../docs/spec.md) explains it; `sweeps/quickstart.yaml` is an
        example). Each section below is one part of it; `tasks[]` means each item of the `tasks` list. Unknown keys
        are errors, and every error names the file and the field. "required" means the key has no default.
        """)


def sections(path: str = "", cls: type = S.SweepSpec) -> list[tuple[str, type]]:
    """(YAML path, dataclass), from SweepSpec down through the fields' types, each section followed by
    its own sections."""
    if cls.__name__ in ENTRIES:  # a task made from a `lm_eval:` entry: the entry's settings are what YAML holds
        entry_path, shown = ENTRIES[cls.__name__]
        return [(entry_path, next(typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)
                                  if getattr(typing.get_type_hints(cls)[f.name], "__name__", "") == shown))]
    found = [(path, cls)]
    for f in dataclasses.fields(cls):
        inner, many = _dataclass_in(typing.get_type_hints(cls)[f.name])
        if inner is not None:
            found += sections(f"{path}.{f.name}".lstrip(".") + ("[]" if many else ""), inner)
    return found


def _dataclass_in(hint) -> tuple[type | None, bool]:
    if dataclasses.is_dataclass(hint):
        return hint, False
    args = [a for a in typing.get_args(hint) if a is not NoneType and a is not Ellipsis]
    if typing.get_origin(hint) in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    if typing.get_origin(hint) in (typing.Union, UnionType) and len(args) == 1:
        return _dataclass_in(args[0])
    return None, False


def _section(path: str, cls: type, probe: "_Probe") -> str:
    source = textwrap.dedent(inspect.getsource(cls))
    tree = ast.parse(source).body[0]
    comments, allowed = _comments(source, tree), _allowed(cls)
    checks, other = _checks(cls)
    title = f"`{path}`" if path else "Top level"
    lines = [f"## {title} ({cls.__name__})", ""]
    doc = DOC_CITATION.sub("", ast.get_docstring(tree) or "")
    lines += [doc, ""] if doc else []
    note = SHAPES.get(cls.__name__) or NOTES.get(cls.__name__)
    lines += [note, ""] if note else []
    lines += ["| key | type | default | allowed | checks | meaning |", "|---|---|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f.name if cls.__name__ in SHAPES else probe.key(path, cls, f)
        inner = _dataclass_in(hints[f.name])[0]
        if key is None or (inner is not None and inner.__name__ in ENTRIES):  # not read from YAML (the spec
            continue  # file's own path), or read as an entry of its own (a task's lm_eval)
        listed = allowed.get(f.name, "")
        said = [c for c in checks.get(f.name, []) if not (listed and listed.replace("`", "") in c)]
        cells = [f"`{key}`", _type(hints[f.name]), _default(f, path, probe), listed, "; ".join(said),
                 comments.get(f.name, "")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if other:
        lines += ["", "Also checked: " + "; ".join(f"`{k}`: {m}" for k, m in other) + "."]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(hint) -> str:
    origin, args = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not Ellipsis]
    if dataclasses.is_dataclass(hint):
        return "mapping (section below)"
    if origin in (typing.Union, UnionType):
        return " or ".join(_type(a) for a in args if a is not NoneType) + (" or null" if NoneType in args else "")
    if origin in (tuple, list):
        return f"list of {_type(args[0])}" if args else "list"
    if hint is dict or origin is dict:
        return "mapping"
    return "any" if hint is typing.Any else getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field, path: str, probe: "_Probe") -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "every default" if dataclasses.is_dataclass(value) else _yaml(value)
    filled = probe.filled(path, f.name)
    return "required" if filled is None else _yaml(filled).replace(MINIMAL["name"], "<name>")


def _yaml(value) -> str:
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _comments(source: str, tree: ast.ClassDef) -> dict[str, str]:
    """Per field: the comment lines right above it and the comment after it."""
    notes = {}  # line -> (text, whether the line is only a comment)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            notes[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    found = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, line = [], node.lineno - 1
            while line in notes and notes[line][1]:
                above.insert(0, notes[line][0])
                line -= 1
            after = [notes[n][0] for n in range(node.lineno, node.end_lineno + 1) if n in notes and not notes[n][1]]
            found[node.target.id] = DOC_CITATION.sub("", " ".join(above + after))
    return found


def _post_init(cls: type) -> ast.FunctionDef | None:
    method = cls.__dict__.get("__post_init__")
    return ast.parse(textwrap.dedent(inspect.getsource(method))).body[0] if method else None


def _self_field(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _allowed(cls: type) -> dict[str, str]:
    """Fields tested against a module constant (`self.kind not in STRUCTURED_KINDS`) or the name pattern."""
    allowed, method = {}, _post_init(cls)
    for node in ast.walk(method) if method else ():
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and isinstance(node.comparators[0], ast.Name) and _self_field(node.left):
            values = getattr(S, node.comparators[0].id, None)
            if isinstance(values, tuple):
                allowed[_self_field(node.left)] = ", ".join(f"`{v}`" for v in values)
        if isinstance(node, ast.Call) and node.args and _self_field(node.args[0]):
            func = ast.unparse(node.func)
            if func == "_check_name" or (func.endswith(".match") and func.split(".")[0] == "NAME_RE"):
                allowed[_self_field(node.args[0])] = f"a name: `{S.NAME_RE.pattern}`"
    allowed.update(_keys_by_name(cls, method))
    return allowed


def _keys_by_name(cls: type, method: ast.FunctionDef | None) -> dict[str, str]:
    """A mapping field whose keys __post_init__ checks against a literal table by another field
    (ScorerSpec: `allowed = {"json_match": {"fields"}, ...}` and `set(self.args) - allowed.get(self.name)`)."""
    tables = {n.targets[0].id: ast.literal_eval(n.value) for n in (ast.walk(method) if method else ())
              if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) and isinstance(n.targets[0], ast.Name)}
    mappings = {f.name for f in dataclasses.fields(cls) if f.default_factory is dict}
    found = {}
    for node in ast.walk(method) if method else ():
        if isinstance(node, ast.Assign):
            names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            used = {_self_field(n) for n in ast.walk(node.value)} & mappings
            for table in names & set(tables):
                for field in used:
                    found[field] = "; ".join(f"{k}: " + ", ".join(f"`{a}`" for a in sorted(v))
                                             for k, v in tables[table].items())
    return found


def _checks(cls: type) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """The ValueError messages of __post_init__, by the field they start with; the rest apart."""
    fields = {f.name for f in dataclasses.fields(cls)}
    by_field, other = {}, []
    method = _post_init(cls)
    for prefix, text in _messages(method.body if method else [], {}):
        head, rest = prefix.split(".")[0], prefix.split(".")[-1]
        if prefix in fields or rest in fields:
            by_field.setdefault(prefix if prefix in fields else rest, []).append(text)
        elif head in fields:
            by_field.setdefault(head, []).append(f"{prefix[len(head) + 1:]}: {text}")
        elif prefix != "…":
            other.append((prefix, text))
    return by_field, other


def _messages(body: list[ast.stmt], loop: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(field, message) of each `raise ValueError(...)`, `for name in ("a", "b")` loops expanded."""
    found = []
    for node in body:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Tuple):
            values = [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]
            found += _messages(node.body, {**loop, node.target.id: values})
            continue
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and ast.unparse(node.exc.func) == "ValueError" \
                and node.exc.args:
            for bound in _bindings(node.exc.args[0], loop):
                text = re.sub(r",? got …$", "", _text(node.exc.args[0], bound))
                if ": " in text:
                    found.append(tuple(text.split(": ", 1)))
        for child in ("body", "orelse", "handlers", "finalbody"):
            found += _messages(getattr(node, child, []), loop)
    return found


def _bindings(message: ast.expr, loop: dict[str, list[str]]) -> list[dict[str, str]]:
    names = {n.id for n in ast.walk(message) if isinstance(n, ast.Name)} & set(loop)
    bindings = [{}]
    for name in names:
        bindings = [{**b, name: v} for b in bindings for v in loop[name]]
    return bindings


def _text(message: ast.expr, bound: dict[str, str]) -> str:
    """A message's text: loop names bound, expressions over module constants evaluated, others as '…'."""
    if isinstance(message, ast.Constant):
        return str(message.value)
    if not isinstance(message, ast.JoinedStr):
        return "…"
    out = []
    for part in message.values:
        if isinstance(part, ast.Constant):
            out.append(str(part.value))
            continue
        names = {n.id for n in ast.walk(part.value) if isinstance(n, ast.Name)}
        if names <= set(bound) | set(vars(S)) | {"str"}:
            out.append(str(eval(compile(ast.Expression(part.value), "<spec>", "eval"), {**vars(S), **bound})))
        else:
            out.append("…")
    return "".join(out)


class _Probe:
    """Loads minimal specs with one key added, to learn what the loader accepts and fills in."""

    def __init__(self, folder: str):
        self.folder = folder

    def _load(self, raw: dict):
        return parse_spec(raw, source="probe.yaml", base_dir=self.folder)

    def _at(self, raw: dict, path: str) -> dict:
        """The mapping at a section path of `raw` (`tasks[].sampling`: the first task's sampling)."""
        node = raw
        for part in filter(None, path.split(".")):
            name, many = part.removesuffix("[]"), part.endswith("[]")
            node = node.setdefault(name, [{}] if many else {})
            node = node[0] if many else node
        return node

    def accepts(self, path: str, key: str, value) -> bool:
        """Whether the loader takes `key` at `path`; a key inside a mapping (`engine.backend`) only where it is
        taken out of the mapping, not passed on in it (any key of `engine` is, to the engine)."""
        raw = json.loads(json.dumps(MINIMAL))
        keys = key.split(".")
        target = self._at(raw, path)
        for k in keys[:-1]:
            target = target.setdefault(k, {})
        target.setdefault(keys[-1], value)
        try:
            loaded = self._load(raw)
        except S.SpecError as e:
            return not ("unknown field" in str(e) and keys[-1] in str(e))
        if len(keys) > 1:
            node = loaded
            for part in [*filter(None, path.split(".")), keys[0]]:
                node = getattr(node, part.removesuffix("[]"))
                node = node[0] if part.endswith("[]") else node
            return keys[-1] not in node
        return True

    def key(self, path: str, cls: type, f: dataclasses.Field) -> str | None:
        """The YAML key of a field: its name, `mapping.name` when it is given inside a mapping field
        (`engine.backend`), or None when the YAML has no such key."""
        value = None if f.default is dataclasses.MISSING else f.default
        if self.accepts(path, f.name, value):
            return f.name
        for sibling in dataclasses.fields(cls):
            if sibling.default_factory is dict and self.accepts(path, f"{sibling.name}.{f.name}", value):
                return f"{sibling.name}.{f.name}"
        return None

    def filled(self, path: str, name: str):
        """What the loader sets a dataclass-required field to when the YAML leaves it out (None: nothing)."""
        if path or name in MINIMAL:
            return None
        try:
            return getattr(self._load(json.loads(json.dumps(MINIMAL))), name)
        except S.SpecError:
            return None
