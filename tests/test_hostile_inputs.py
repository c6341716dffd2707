"""Hostile input: each case is the real command, `python -m jobs.sweep SPEC --output DIR`, run
in-process through `jobs.sweep.main`, and `raysweep plan SPEC` beside it. Each must exit 2 with one line on
stderr naming the file and the line or field, before Ray is started (`ray.init` here fails the test if it
is called at all), leaving an existing output byte-for-byte as it was."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SPEC = """\
name: hostile
models:
  - name: tiny
    path: builtin:tiny
tasks:
  - name: qa
    data: qa.jsonl
    id_column: id
    prompt: "Q: {question}\\nA:"
    target: answer
    scorer: exact_match
    sampling: {max_tokens: 4}
shards: {max_samples: 2}
"""
ROWS = [{"id": f"r{i}", "question": f"{i}+{i}", "answer": str(2 * i)} for i in range(4)]


def spec_with(tmp: Path, old: str, new: str) -> list[str]:
    text = (tmp / "sweep.yaml").read_text(encoding="utf-8")
    assert old in text, old
    (tmp / "sweep.yaml").write_text(text.replace(old, new, 1), encoding="utf-8")
    return []


def rows_with(tmp: Path, lines: list[str], name: str = "qa.jsonl") -> list[str]:
    (tmp / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return []


def row(**fields) -> str:
    return json.dumps({**ROWS[0], **fields})


def big_file_with_a_bad_byte(tmp: Path) -> list[str]:
    lines = [json.dumps({"id": f"r{i}", "question": f"{i}+{i}", "answer": str(2 * i)}).encode() for i in range(5000)]
    lines[4320] = b'{"id": "r4320", "question": "caf\xe9", "answer": "1"}'  # latin-1, on line 4321
    (tmp / "qa.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return []


def messages_rows(value):
    """A `messages: m` task whose second row's `m` is `value`."""
    def setup(tmp: Path) -> list[str]:
        spec_with(tmp, 'prompt: "Q: {question}\\nA:"', "messages: m")
        good = [{"role": "user", "content": "hi"}]
        return rows_with(tmp, [json.dumps({"id": "r0", "m": good, "answer": "1"}),
                               json.dumps({"id": "r1", "m": value, "answer": "1"})])
    return setup


def loglik(tmp: Path, lines: list[str]) -> list[str]:
    """The task as `type: loglikelihood` over a `choices` column, with these rows."""
    spec_with(tmp, "    scorer: exact_match\n", "    type: loglikelihood\n    choices: choices\n")
    spec_with(tmp, "    sampling: {max_tokens: 4}\n", "")
    return rows_with(tmp, lines)


def laughs(indent: str) -> str:
    """A "billion laughs" alias chain: `i` expands to 10**9 values (a..i under `indent`, in block style)."""
    lines = [f"{indent}a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{indent}{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def parquet_with_a_null(tmp: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["r0", "r1"], "question": ["1+1", "2+2"], "answer": ["2", None]}), tmp / "qa.parquet")
    return []


def engine_with(mapping: str):
    """The model's `engine:` section, as YAML text."""
    return lambda tmp: spec_with(tmp, "path: builtin:tiny", f"path: builtin:tiny\n    engine: {mapping}")


def parquet_column_twice(tmp: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = [pa.array(["r0"]), pa.array(["first"]), pa.array(["second"]), pa.array(["1"])]
    pq.write_table(pa.Table.from_arrays(columns, names=["id", "question", "question", "answer"]), tmp / "qa.parquet")
    return []


def config_only_model(tmp: Path) -> list[str]:
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    return []


def then(*steps):
    def run(tmp: Path) -> list[str]:
        return [arg for step in steps for arg in step(tmp)]
    return run


# (id, setup(tmp) -> extra command-line arguments, the line expected after "raysweep: error: " ({spec},
# {data}, {dir}: the spec file, the data file, the spec's folder); it names the file and the line or field)
CASES = [
    ("format-spec", lambda t: spec_with(t, '"Q: {question}\\nA:"', '"Q: {question:d}"'),
     "{data}:1: tasks.qa.prompt 'Q: {question:d}' cannot be rendered from this row: ValueError: Unknown format code 'd'"),
    ("index-out-of-range", lambda t: spec_with(t, '"Q: {question}\\nA:"', '"Q: {question[999]}"'),
     "{data}:1: tasks.qa.prompt 'Q: {question[999]}' cannot be rendered from this row: IndexError: string index out of range"),
    ("stray-brace", lambda t: spec_with(t, '"Q: {question}\\nA:"', '"Q: {question"'),
     "{spec}: tasks.qa.prompt: 'Q: {question' is not a valid template: expected '}' before end of string"),
    ("positional-placeholder", lambda t: spec_with(t, '"Q: {question}\\nA:"', '"Q: {0}"'),
     "{spec}: tasks.qa.prompt: placeholder {0} must name a column"),
    ("data-is-a-directory", lambda t: (os.remove(t / "qa.jsonl"), (t / "qa.jsonl").mkdir(), [])[-1],
     "{data}: is a directory; `data:` names one JSONL or Parquet file"),
    ("missing-data-file", lambda t: (os.remove(t / "qa.jsonl"), [])[-1], "{data}: no such data file"),
    ("lone-surrogate-in-a-row", lambda t: rows_with(t, [row(), row(id="r1"), '{"id": "r2", "question": "x\\ud800", "answer": "1"}']),
     "{data}:3: column 'question' holds a lone surrogate"),
    ("non-utf8-on-line-4321-of-5000", big_file_with_a_bad_byte, "{data}:4321: not UTF-8 text (byte 0xe9 at column 33)"),
    ("not-json", lambda t: rows_with(t, [row(), '{"id": "r1", "question": ']), "{data}:2: not valid JSON: Expecting value"),
    ("key-twice", lambda t: rows_with(t, [row(), '{"id": "r1", "question": "1+1", "answer": "2", "answer": "3"}']),
     "{data}:2: key 'answer' is given twice in one object (JSON readers differ on which one counts); give it once"),
    ("non-object-json-line", lambda t: rows_with(t, [row(), "[1, 2]"]), "{data}:2: expected a JSON object, got list"),
    ("id-column-missing", lambda t: rows_with(t, [row(), json.dumps({"question": "q", "answer": "a"})]),
     "{data}:2: missing column 'id' (the task 'qa' needs it as its `id_column` column)"),
    ("duplicate-sample-ids", lambda t: rows_with(t, [row(), row(id="r1"), row()]),
     "{data}:3: duplicate sample id 'r0' (first at 1)"),
    ("no-rows", lambda t: rows_with(t, [""]), "{data}: task 'qa' has no rows"),
    ("parquet-that-is-not-parquet", then(lambda t: spec_with(t, "data: qa.jsonl", "data: qa.parquet"),
                                         lambda t: ((t / "qa.parquet").write_text("id,question\n"), [])[-1]),
     "{dir}/qa.parquet: not a readable Parquet file: Parquet magic bytes not found"),
    ("ebnf-that-does-not-parse", lambda t: spec_with(t, "    scorer: exact_match\n", "    scorer: exact_match\n"
                                                     "    structured: {grammar: 'root ::= \"a\" | ('}\n"),
     "{spec}: tasks.qa.structured.grammar: xgrammar cannot parse it: EBNF parser error at line 1, column 17: Expect element"),
    ("json-schema-that-is-not-one", lambda t: spec_with(t, "    scorer: exact_match\n", "    scorer: exact_match\n"
                                                        "    structured: {json_schema: {type: objekt}}\n"),
     "{spec}: tasks.qa.structured.json_schema: not a valid JSON schema: 'objekt' is not valid"),
    ("regex-that-does-not-compile", lambda t: spec_with(t, "    scorer: exact_match\n", "    scorer: exact_match\n"
                                                        "    structured: {regex: '([A-D]'}\n"),
     "{spec}: tasks.qa.structured.regex: does not compile: missing ), unterminated subpattern"),
    ("local-model-path-that-does-not-exist", lambda t: spec_with(t, "builtin:tiny", "/nonexistent/model"),
     "{spec}: model tiny: cannot load '/nonexistent/model': no such directory"),
    ("model-path-that-is-a-file", lambda t: spec_with(t, "builtin:tiny", "./qa.jsonl"),  # from the spec's folder
     "{spec}: model tiny: cannot load './qa.jsonl' ({data}): not a directory"),
    ("unknown-builtin-model", lambda t: spec_with(t, "builtin:tiny", "builtin:huge"),
     "{spec}: model tiny: cannot load 'builtin:huge': unknown builtin model; known: builtin:tiny"),
    ("hub-id-while-offline", lambda t: spec_with(t, "builtin:tiny", "raysweep-tests/no-such-model"),
     "{spec}: model tiny: cannot load 'raysweep-tests/no-such-model': not a local directory, not in the Hugging "
     "Face cache, and the hub cannot be reached (HF_HUB_OFFLINE is set)"),
    ("system-message-without-chat", lambda t: spec_with(t, "    target: answer\n", "    target: answer\n    system: Be brief.\n"),
     "{spec}: tasks[0].system: a system message needs the chat template: set `chat: true` (or use "
     "`messages`); a plain prompt would drop it"),
    ("reproducible-not-a-bool", lambda t: spec_with(t, "shards: {max_samples: 2}\n", "shards: {max_samples: 2}\nreproducible: yes please\n"),
     "{spec}: reproducible: must be true or false, got 'yes please'"),
    ("reproducible-with-flashinfer", then(lambda t: spec_with(t, "shards: {max_samples: 2}\n", "shards: {max_samples: 2}\nreproducible: true\n"),
                                          lambda t: spec_with(t, "    path: builtin:tiny\n", "    path: builtin:tiny\n"
                                                              "    engine: {attention_backend: FLASHINFER}\n")),
     "{spec}: model tiny: reproducible: true cannot run with the FLASHINFER attention backend (on an H100 only "
     "TRITON_ATTN repeated its outputs across batches; FLASH_ATTN differed even between identical batches): drop "
     "engine.attention_config"),
    ("reproducible-with-eager", then(lambda t: spec_with(t, "shards: {max_samples: 2}\n", "shards: {max_samples: 2}\nreproducible: true\n"),
                                     lambda t: spec_with(t, "    path: builtin:tiny\n", "    path: builtin:tiny\n"
                                                         "    engine: {enforce_eager: true}\n")),
     "{spec}: model tiny: reproducible: true cannot run with enforce_eager (vLLM 0.26's eager kernels gave other "
     "outputs in other batches, on an H100; CUDA graphs and torch.compile did not): drop engine.enforce_eager"),
    ("reproducible-with-chunked-prefill-on", then(lambda t: spec_with(t, "shards: {max_samples: 2}\n", "shards: {max_samples: 2}\nreproducible: true\n"),
                                                  lambda t: spec_with(t, "    target: answer\n", "    target: answer\n"
                                                                      "    chunked_prefill: \"on\"\n")),
     "{spec}: tasks.qa.chunked_prefill: on cannot run with reproducible: true (whether a prompt is chunked depends "
     "on its neighbours): use auto or off"),
    ("engine-vllm-without-vllm", lambda t: spec_with(t, "    path: builtin:tiny\n", "    path: builtin:tiny\n    engine: vllm\n"),
     "{spec}: model tiny: engine backend vllm needs vLLM, which is not installed here"),
    ("max-tokens-over-the-models-length", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 40000}"),
     "{spec}: tasks.qa.sampling.max_tokens 40000 leaves no room for a prompt in model tiny's max_model_len 32768; "
     "lower max_tokens"),
    ("max-tokens-over-max-model-len", then(lambda t: spec_with(t, "    path: builtin:tiny\n", "    path: builtin:tiny\n"
                                                               "    engine: {max_model_len: 4096}\n"),
                                           lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 8000}") and []),
     "{spec}: tasks.qa.sampling.max_tokens 8000 leaves no room for a prompt in model tiny's max_model_len 4096; "
     "lower max_tokens"),
    ("duplicate-top-level-key", lambda t: spec_with(t, "shards:", "tasks: []\nshards:"),
     "{spec}:13: not valid YAML: duplicate key 'tasks' (first at line 5)"),
    ("duplicate-key-in-a-flow-mapping", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 8, max_tokens: 4000}"),
     "{spec}:12: not valid YAML: duplicate key 'max_tokens' (first at line 12)"),
    ("boolean-as-integer", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: yes}"),
     "{spec}: tasks[0].sampling.max_tokens: must be an integer >= 1, got True"),
    ("misspelt-key", lambda t: spec_with(t, "    prompt:", "    promt:"),
     "{spec}: tasks[0].promt: unknown field 'promt' (did you mean 'prompt'?)"),
    ("misspelt-section-key", lambda t: spec_with(t, "shards: {max_samples: 2}", "shards: {max_sample: 2}"),
     "{spec}: shards.max_sample: unknown field 'max_sample' (did you mean 'max_samples'?)"),
    ("empty-tasks-list", lambda t: (t / "sweep.yaml").write_text(SPEC.split("tasks:")[0] + "tasks: []\n") and [],
     "{spec}: tasks: at least one task is required"),
    ("unknown-scorer", lambda t: spec_with(t, "scorer: exact_match", "scorer: f1"),
     "{spec}: tasks[0].scorer.f1: unknown scorer"),
    ("negative-max-samples", lambda t: spec_with(t, "{max_samples: 2}", "{max_samples: -5}"),
     "{spec}: shards.max_samples: must be an integer >= 1, got -5"),
    ("lone-surrogate-in-the-spec", lambda t: spec_with(t, '"Q: {question}\\nA:"', '"Q: \\ud800{question}"'),
     "{spec}: tasks[0].prompt: holds a lone surrogate (\\ud800), which is not text"),
    ("spec-not-utf8", lambda t: ((t / "sweep.yaml").write_bytes(SPEC.encode().replace(b"name: qa", b"name: q\xe4")), [])[-1],
     "{spec}:6: not UTF-8 text (byte 0xe4)"),
    ("spec-not-yaml", lambda t: spec_with(t, "shards: {max_samples: 2}", "shards: {max_samples: 2"),
     "{spec}:14: not valid YAML: expected ',' or '}'"),
    ("spec-is-a-directory", lambda t: (os.remove(t / "sweep.yaml"), (t / "sweep.yaml").mkdir(), [])[-1],
     "{spec}: is a directory, not a spec file"),
    # each of these would otherwise be a traceback, a silent wrong result, or a minute-long hang
    ("messages-null", messages_rows(None), "{data}:2: column 'm' (tasks.qa.messages) must be a non-empty list of "
     '{"role": ..., "content": ...} messages, got null'),
    ("messages-a-string", messages_rows("text"), "{data}:2: column 'm' (tasks.qa.messages) must be a non-empty list "
     'of {"role": ..., "content": ...} messages, got a string'),
    ("messages-empty", messages_rows([]), "{data}:2: column 'm' (tasks.qa.messages) must be a non-empty list "
     'of {"role": ..., "content": ...} messages, got an empty list'),
    ("message-without-content", messages_rows([{"role": "user", "text": "hi"}]),
     "{data}:2: column 'm' (tasks.qa.messages) message 0: has no 'content' (keys: 'role', 'text')"),
    ("message-content-null", messages_rows([{"role": "user", "content": None}]),
     "{data}:2: column 'm' (tasks.qa.messages) message 0: 'content' must be a string, got null"),
    ("message-not-an-object", messages_rows(["hi"]),
     "{data}:2: column 'm' (tasks.qa.messages) message 0: must be an object"),
    ("recursive-alias-under-an-unknown-key", lambda t: spec_with(t, "shards:", "x: &a [*a]\nshards:"),
     "{spec}: x: unknown field 'x'"),
    ("recursive-alias-under-engine", lambda t: spec_with(t, "    path: builtin:tiny\n",
                                                         "    path: builtin:tiny\n    engine: {x: &a [*a]}\n"),
     "{spec}: models[0].engine.x[0]: holds itself (a recursive YAML alias)"),
    ("billion-laughs-under-an-unknown-key", lambda t: spec_with(t, "shards:", "lol:\n" + laughs("  ") + "shards:"),
     "{spec}: lol: unknown field 'lol'"),
    ("billion-laughs-under-engine", lambda t: spec_with(t, "    path: builtin:tiny\n", "    path: builtin:tiny\n"
                                                        "    engine:\n" + laughs("      ")),
     "{spec}: models[0].engine.f: expands to more than 1,000,000 values through YAML aliases"),
    ("nested-too-deep", lambda t: spec_with(t, "    path: builtin:tiny\n", "    path: builtin:tiny\n"
                                            "    engine: {x: " + "[" * 150 + "]" * 150 + "}\n"),
     "{spec}: models[0].engine.x" + "[0]" * 14 + "…: nested deeper than 100 levels"),
    ("output-a-number", lambda t: spec_with(t, "shards:", "output: 5\nshards:"),
     "{spec}: output: must be a path or a filesystem URI (a string), got 5"),
    ("output-a-list", lambda t: spec_with(t, "shards:", "output: [a, b]\nshards:"),
     "{spec}: output: must be a path or a filesystem URI (a string), got ['a', 'b']"),
    ("output-a-mapping", lambda t: spec_with(t, "shards:", "output: {a: 1}\nshards:"),
     "{spec}: output: must be a path or a filesystem URI (a string), got {'a': 1}"),
    ("null-id", lambda t: rows_with(t, [row(), row(id=None)]),
     "{data}:2: column 'id' is null (the task 'qa' needs a value as its `id_column` column)"),
    ("null-in-a-prompt-column", lambda t: rows_with(t, [row(), row(id="r1", question=None)]),
     "{data}:2: column 'question' is null (the task 'qa' needs a value as its prompt placeholder {question})"),
    ("null-target", lambda t: rows_with(t, [row(), row(id="r1", answer=None)]),
     "{data}:2: column 'answer' is null (the task 'qa' needs a value as its `target` column)"),
    ("null-target-in-parquet", then(lambda t: spec_with(t, "data: qa.jsonl", "data: qa.parquet"), parquet_with_a_null),
     "{dir}/qa.parquet:row 1: column 'answer' is null (the task 'qa' needs a value as its `target` column)"),
    ("name-with-a-trailing-newline", lambda t: spec_with(t, "  - name: tiny\n", '  - name: "tiny\\n"\n'),
     "{spec}: models[0].name: 'tiny\\n' must be letters, digits, '.', '_' or '-'"),
    ("sweep-name-with-a-trailing-newline", lambda t: spec_with(t, "name: hostile", 'name: "hostile\\n"'),
     "{spec}: name: 'hostile\\n' must be letters, digits, '.', '_' or '-'"),
    ("name-an-unquoted-number", lambda t: spec_with(t, "name: hostile", "name: 13"),
     '{spec}: name: 13 is a number in YAML; quote it ("13") to use it as a name'),
    ("data-a-uri", lambda t: spec_with(t, "data: qa.jsonl", "data: s3://b/x.jsonl"),
     "{spec}: tasks[0].data: 's3://b/x.jsonl' must be a local file"),
    ("temperature-nan", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 4, temperature: .nan}"),
     "{spec}: tasks[0].sampling.temperature: must be a finite number >= 0, got nan"),
    ("temperature-inf", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 4, temperature: .inf}"),
     "{spec}: tasks[0].sampling.temperature: must be a finite number >= 0, got inf"),
    ("num-cpus-nan", lambda t: spec_with(t, "shards:", "actors: {num_cpus: .nan}\nshards:"),
     "{spec}: actors.num_cpus: must be > 0, got nan"),
    ("model-dir-without-a-tokenizer", then(lambda t: spec_with(t, "builtin:tiny", "./m"), config_only_model),
     "{spec}: model tiny: cannot load './m' ({dir}/m): no tokenizer files in {dir}/m (tokenizer.json, "
     "tokenizer_config.json, tokenizer.model or vocab files): not a complete Hugging Face model directory"),
    # the scoring kinds: log-likelihood, n completions and pass@k, code_exec, replay
    ("loglikelihood-row-without-choices", lambda t: loglik(t, [row(choices=["2", "3"]), row(id="r1")]),
     "{data}:2: missing column 'choices' (the task 'qa' needs it as its `choices` column)"),
    ("loglikelihood-choices-empty", lambda t: loglik(t, [row(choices=["2", "3"]), row(id="r1", choices=[])]),
     "{data}:2: column 'choices' (tasks.qa.choices) must be a non-empty list of choice texts, got an empty list"),
    ("loglikelihood-target-index-out-of-range", lambda t: loglik(t, [row(choices=["2", "3"], answer=2)]),
     "{data}:1: column 'answer' (tasks.qa.target): target index 2 is out of range for 2 choices"),
    ("loglikelihood-target-not-a-choice", lambda t: loglik(t, [row(choices=["2", "3"], answer="four")]),
     "{data}:1: column 'answer' (tasks.qa.target): target 'four' is neither a choice's index nor one of the choices"),
    ("loglikelihood-with-a-scorer", lambda t: spec_with(t, "    target: answer\n", "    target: answer\n"
                                                         "    type: loglikelihood\n    choices: [a, b]\n"),
     "{spec}: tasks[0].scorer: not for a loglikelihood task (it is scored acc and acc_norm); drop it"),
    ("n-below-one", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 4, n: 0}"),
     "{spec}: tasks[0].sampling.n: must be an integer >= 1, got 0"),
    ("pass-at-k-above-n", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 4, n: 4, temperature: 0.8}\n"
                                              "    pass_at: [1, 10]"),
     "{spec}: tasks[0].pass_at: k=10 is above sampling.n=4 (pass@k needs n >= k completions per prompt)"),
    ("code-exec-program-names-a-missing-column", lambda t: spec_with(
        t, "scorer: exact_match", 'scorer: {name: code_exec, program: "{completion}\\n{tests}"}'),
     "{data}:1: missing column 'tests' (the task 'qa' needs it as its code_exec program placeholder {tests})"),
    ("code-exec-program-without-the-completion", lambda t: spec_with(
        t, "scorer: exact_match", 'scorer: {name: code_exec, program: "{question}"}'),
     "{spec}: tasks[0].scorer.program: '{question}' never places the model's output: it needs {completion}"),
    ("code-exec-program-with-text-on-the-completions-last-line", lambda t: spec_with(
        t, "scorer: exact_match", 'scorer: {name: code_exec, program: "{completion}{tests}"}'),
     "{spec}: tasks[0].scorer.program: '{completion}{tests}' puts text on the completion's last line: start what "
     "follows {completion} with a newline (a model's `#` or `\\` would take that text into its own)"),
    ("replay-column-missing", lambda t: spec_with(t, "    target: answer\n", "    target: answer\n"
                                                  "    replay: {column: output}\n"),
     "{data}:1: missing column 'output' (the task 'qa' needs it as its `replay.column` (its completions))"),
    # each of these would otherwise be a bare KeyError after the GPU work, a silent waste, results filed under a model
    ("code-exec-program-that-cannot-render-a-row", then(
        lambda t: spec_with(t, "scorer: exact_match", 'scorer: {name: code_exec, program: "{completion}\\nassert '
                            '{meta[fn]}() == 1"}'),
        lambda t: rows_with(t, [row(meta={"fn": "f"}), row(id="r1", meta={})])),
     "{data}:2: tasks.qa.scorer.program '{completion}\\nassert {meta[fn]}() == 1' cannot be rendered from this row "
     "and an empty completion: KeyError: 'fn'"),
    ("n-above-one-at-temperature-0", lambda t: spec_with(t, "{max_tokens: 4}", "{max_tokens: 4, n: 4}"),
     "{spec}: tasks[0].sampling.n: 4 completions at temperature 0 (greedy) would all be the same completion; set a "
     "temperature > 0, or n: 1"),
    ("replay-model-named-as-a-spec-model", lambda t: spec_with(t, "    target: answer\n", "    target: answer\n"
                                                               "    replay: {column: output, model: tiny}\n"),
     "{spec}: tasks[0].replay.model: 'tiny' is the name of models[0]; replayed completions are not that model's: "
     "give them a name of their own"),
    # settings raysweep reads itself, and keys YAML reads as numbers: refused here, not once Ray or engines are up
    ("max-num-seqs-text", engine_with("{max_num_seqs: x}"),
     "{spec}: models[0].engine.max_num_seqs: must be an integer >= 1, got 'x'"),
    ("max-num-seqs-negative", engine_with("{max_num_seqs: -1}"),
     "{spec}: models[0].engine.max_num_seqs: must be an integer >= 1, got -1"),
    ("compilation-config-text", engine_with("{compilation_config: fast}"),
     "{spec}: models[0].engine.compilation_config: must be a mapping or an integer mode, got 'fast'"),
    ("num-cpus-below-rays-finest-fraction", lambda t: spec_with(t, "shards:", "actors: {num_cpus: 0.00001}\nshards:"),
     "{spec}: actors.num_cpus: 1e-05 is below 0.0001, the finest fraction of a resource Ray takes"),
    ("engine-key-a-number", engine_with("{1: 2}"),
     "{spec}: models[0].engine: key 1 is not text (YAML reads it as int): quote it"),
    ("json-schema-property-a-number", lambda t: spec_with(t, "    scorer: exact_match\n", "    scorer: exact_match\n"
                                                          "    structured: {json_schema: {type: object, properties: "
                                                          "{1: {type: string}}}}\n"),
     "{spec}: tasks[0].structured.json_schema.properties: key 1 is not text (YAML reads it as int): quote it"),
    ("regex-group-the-pattern-lacks", lambda t: spec_with(t, "scorer: exact_match",
                                                          'scorer: {name: regex_match, pattern: "(\\\\d+)", group: 5}'),
     "{spec}: tasks[0].scorer.group: the pattern has no group 5 (its groups: 0 to 1)"),
    ("choice-choices-a-string", lambda t: spec_with(t, "scorer: exact_match", "scorer: {name: choice, choices: ABCD}"),
     "{spec}: tasks[0].scorer.choices: must be a list of non-empty strings, got 'ABCD'"),
    ("json-match-fields-a-string", lambda t: spec_with(t, "scorer: exact_match", "scorer: {name: json_match, fields: name}"),
     "{spec}: tasks[0].scorer.fields: must be a list of non-empty strings, got 'name'"),
    ("json-match-target-not-json", then(lambda t: spec_with(t, "scorer: exact_match", "scorer: json_match"),
                                        lambda t: rows_with(t, [row(answer='{"a": 1}'), row(id="r1", answer="not json")])),
     "{data}:2: column 'answer' (tasks.qa.target): not JSON, which scorer json_match compares against: Expecting value"),
    ("target-none-of-the-choice-set", then(lambda t: spec_with(t, "scorer: exact_match",
                                                             "scorer: exact_match\n    structured: {choice: [up, down]}"),
                                           lambda t: rows_with(t, [row(answer=" up"), row(id="r1", answer="left")])),
     "{data}:2: column 'answer' (tasks.qa.target) 'left' is none of tasks.qa.structured's choices ['up', 'down'], "
     "which generation is held to: scorer exact_match would give it 0 whatever the model generates"),
    ("parquet-column-twice", then(lambda t: spec_with(t, "data: qa.jsonl", "data: qa.parquet"), parquet_column_twice),
     "{dir}/qa.parquet: column 'question' is there twice; name each column once"),
    ("ray-that-does-not-start", lambda t: ["--address", "127.0.0.1:1"],
     "--address 127.0.0.1:1: no Ray there to connect to (Connection refused)"),
]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def sweep_dir(tmp_path, monkeypatch):
    """A valid sweep (spec and data) in tmp_path/spec, an earlier run's output in tmp_path/out, and a
    `ray.init` that fails the test if anything reaches it."""
    import ray

    folder = tmp_path / "spec"
    folder.mkdir()
    (folder / "sweep.yaml").write_text(SPEC)
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    (out / "results" / "model=tiny" / "task=qa").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"spec_hash": "0123", "shards": {"tiny/qa/00000": {"state": "committed"}}}))
    (out / "results" / "model=tiny" / "task=qa" / "shard-00000.parquet").write_bytes(b"PAR1 an earlier result PAR1")
    (out / "summary.parquet").write_bytes(b"PAR1 an earlier summary PAR1")

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called: a hostile input got past the checks made before Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub-id case: what a machine without network sees
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable, wherever the tests run
    return folder, out


@pytest.mark.parametrize("setup, expected", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_hostile_input_is_one_line_before_ray_and_the_output_is_untouched(sweep_dir, capsys, setup, expected):
    import ray

    from jobs.cli import main as cli_main
    from jobs.sweep import main

    folder, out = sweep_dir
    extra = setup(folder)
    spec = folder / "sweep.yaml"
    line = "raysweep: error: " + expected.replace("{spec}", str(spec)).replace("{data}", str(folder / "qa.jsonl")) \
        .replace("{dir}", str(folder))
    before, ray_before = snapshot(out), ray.is_initialized()
    started = time.perf_counter()
    code = main([str(spec), "--output", str(out), *extra])
    took = time.perf_counter() - started
    stdout, stderr = capsys.readouterr()
    assert code == 2, stderr
    assert stderr.endswith("\n") and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(line), f"\n{stderr}{line}"
    assert "starting a local Ray" not in stdout and "connecting to Ray" not in stdout
    assert ray.is_initialized() == ray_before
    assert snapshot(out) == before
    assert took < 300, f"{took:.1f}s to refuse it"  # a hang bound only
    if not extra:  # `raysweep plan` makes the same checks and says the same
        assert cli_main(["plan", str(spec)]) == 2
        assert capsys.readouterr().err == stderr


def test_ray_that_fails_to_start_is_one_line_and_releases_the_output(sweep_dir, capsys, monkeypatch):
    """What the address probe cannot see (no cluster for `auto`, a GCS that never answers) is caught around
    ray.init: one line naming the address, exit 2, the output's lock released, and the folders the run made for
    an output it never wrote in taken away again (a folder that was there before stays)."""
    import ray

    from cluster.store.sink import ResultSink
    from cluster.inputs.spec_file import load_spec
    from jobs.sweep import main

    folder, out = sweep_dir

    def refused(*args, **kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr("jobs.ray_start.gcs_answer", lambda address: "other")  # `auto` may find another Ray here
    # the run stops what it half started (jobs/local_ray.py shutdown): here, in the test's process, that would be the
    # session's Ray of this pytest worker (ray_local), which every later test on the worker then found gone
    stopped = []
    monkeypatch.setattr("jobs.local_ray.shutdown", lambda: stopped.append(True))
    assert main([str(folder / "sweep.yaml"), "--output", str(out.parent / "fresh" / "out"), "--address",
                 "auto"]) == 2
    assert stopped  # it did stop what it had started
    stdout, stderr = capsys.readouterr()
    assert stderr == ("raysweep: error: --address auto: Ray did not connect: Could not find any running Ray "
                      "instance. Please specify the one to connect to.\n")
    assert not (out.parent / "fresh").exists()
    (tmp := out.parent / "there").mkdir()
    assert main([str(folder / "sweep.yaml"), "--output", str(tmp), "--address", "auto"]) == 2
    assert tmp.is_dir() and not (tmp / ".lock").exists()
    ResultSink(str(tmp), load_spec(folder / "sweep.yaml")).close()  # not held by the failed run


def test_an_output_whose_manifest_is_a_directory_is_one_line_before_ray(sweep_dir, capsys):
    """`OUT/manifest.json` a directory was pyarrow's OSError traceback ("Cannot open for reading")."""
    from jobs.sweep import main

    folder, out = sweep_dir
    (out / "manifest.json").unlink()
    (out / "manifest.json").mkdir()
    assert main([str(folder / "sweep.yaml"), "--output", str(out)]) == 2
    assert capsys.readouterr().err == (f"raysweep: error: output {out}: manifest.json: {out}/manifest.json is not a "
                                       "file, so not a raysweep manifest; restore it, or choose another output\n")
    assert (out / "manifest.json").is_dir()


def test_the_command_itself_exits_2_at_once_for_a_hub_id_offline(tmp_path):
    """The same as a process, as a user runs it: it once retried ten times over 50 s."""
    import subprocess

    from tests.conftest import ROOT

    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SPEC.replace("builtin:tiny", "raysweep-tests/no-such-model"))
    proc = subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(tmp_path / "out")],
                          cwd=ROOT, env=os.environ | {"HF_HUB_OFFLINE": "1", "RAY_ADDRESS": "local"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"raysweep: error: {spec}: model tiny: cannot load 'raysweep-tests/no-such-model': not a "
                           "local directory, not in the Hugging Face cache, and the hub cannot be reached "
                           "(HF_HUB_OFFLINE is set)\n")
    assert "Ray" not in proc.stdout and not (tmp_path / "out").exists()  # subprocess's timeout bounds a hang


def _sweep_process(spec: Path, *args: str) -> subprocess.CompletedProcess:
    from tests.conftest import ROOT

    return subprocess.run([sys.executable, "-m", "jobs.sweep", str(spec), *args], cwd=ROOT,
                          env=os.environ | {"RAY_ADDRESS": "local"}, capture_output=True, text=True, timeout=60)


def test_a_named_pipe_as_the_data_file_is_one_line_not_a_hang(tmp_path):
    """`open()` on a FIFO waited for a writer forever, with no message (plan and run alike)."""
    os.mkfifo(tmp_path / "qa.jsonl")
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SPEC)
    from tests.conftest import ROOT

    for command in (["-m", "jobs.sweep", str(spec), "--output", str(tmp_path / "out")],
                    ["-m", "jobs.cli", "plan", str(spec)]):
        proc = subprocess.run([sys.executable, *command], cwd=ROOT, env=os.environ | {"RAY_ADDRESS": "local"},
                              capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stderr) == (2, f"raysweep: error: {tmp_path / 'qa.jsonl'}: is a named pipe "
                                                     "(FIFO); `data:` names one JSONL or Parquet file\n"), command
    assert not (tmp_path / "out").exists()


def test_a_named_pipe_as_the_spec_file_is_one_line_not_a_hang(tmp_path):
    """`mkfifo fifo.yaml; raysweep run fifo.yaml` waited for a writer forever, with no message."""
    from tests.conftest import ROOT

    os.mkfifo(spec := tmp_path / "fifo.yaml")
    for command in (["run", str(spec), "--output", str(tmp_path / "out")], ["plan", str(spec)]):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", *command], cwd=ROOT,
                              env=os.environ | {"RAY_ADDRESS": "local"}, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stderr) == (2, f"raysweep: error: {spec}: is a named pipe (FIFO), not a spec "
                                                     "file\n"), command
    assert not (tmp_path / "out").exists()


def test_an_output_that_keeps_nothing_is_refused_before_ray(tmp_path):
    """`--output mock://x` ran to exit 0, "results: mock://x", everything written to memory and gone."""
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SPEC)
    for output, why in (("mock://x", "mock:// is pyarrow's in-memory filesystem, gone when the run ends"),
                        ("nope://y", "nope:// is not a filesystem raysweep writes to")):
        proc = _sweep_process(spec, "--output", output)
        assert proc.returncode == 2 and proc.stderr.startswith(f"raysweep: error: output {output}: cannot be opened: {why}; ")
        assert proc.stderr.count("\n") == 1 and "Ray is up" not in proc.stdout


def test_pool_commands_on_an_address_where_nothing_listens_are_one_line_at_once():
    """`raysweep pool status --address 127.0.0.1:1` hung (615 s before it was killed)."""
    from tests.conftest import ROOT

    for command in (["status"], ["down"], ["down", "--force"]):
        proc = subprocess.run([sys.executable, "-m", "jobs.cli", "pool", *command, "--address", "127.0.0.1:1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("raysweep: error: --address 127.0.0.1:1: no Ray "
                                                               "there to connect to"), proc.stderr
        assert proc.stderr.count("\n") == 1  # subprocess's timeout bounds a hang


@pytest.mark.parametrize("option, value, says", [("--min-replicas", "-3", "-3: must be at least 0"),
                                                  ("--http-port", "99999", "99999: must be at most 65535")])
def test_pool_up_options_out_of_range_are_refused_before_ray(capsys, option, value, says):
    """They were checked only once Ray was joined (where there was none, the error was the address's)."""
    from jobs.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["pool", "up", "spec.yaml", option, value, "--address", "127.0.0.1:1"])
    assert stop.value.code == 2 and f"argument {option}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("row, says", [
    ('{"id": "b", "question": ' + "[" * 50000 + "]" * 50000 + ', "answer": "2"}',
     "qa.jsonl:5: JSON nested too deep to read (thousands of levels)"),
    ('{"id": "b", "question": "2", "answer": ' + "9" * 5000 + "}",
     "qa.jsonl:5: not a value raysweep reads: Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_a_row_nested_50000_deep_or_an_integer_of_5000_digits_is_one_line(tmp_path, row, says):
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.data import DataError
    from cluster.inputs.spec_file import load_spec

    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + row + "\n")
    (tmp_path / "sweep.yaml").write_text(SPEC)
    with pytest.raises(DataError) as err:
        check_inputs(load_spec(tmp_path / "sweep.yaml"))
    assert str(err.value).startswith(f"{tmp_path / says}")


def test_an_integer_of_5000_digits_in_the_spec_is_one_line(tmp_path):
    from cluster.contracts.spec import SpecError
    from cluster.inputs.spec_file import load_spec

    (tmp_path / "sweep.yaml").write_text(SPEC.replace("max_samples: 2", "max_samples: " + "9" * 5000))
    with pytest.raises(SpecError, match="sweep.yaml: not a value raysweep reads: Exceeds the limit"):
        load_spec(tmp_path / "sweep.yaml")


def test_a_ray_client_address_is_refused_for_a_sweep_in_one_line_and_kept_for_the_pool():
    """`run --address ray://...` was "Ray is up", then an AssertionError traceback from the autoscaler's SDK, which
    Ray Client does not offer."""
    from jobs.ray_start import RayStartError, check_ray_address

    with pytest.raises(RayStartError, match=r"^--address ray://head:10001: a Ray Client address, which a sweep "
                                            r"cannot run through .*`ray job submit`$"):
        check_ray_address("ray://head:10001", "--address")
    with pytest.raises(RayStartError, match=r"^--address ray://nohost\.invalid: no Ray there to connect to"):
        check_ray_address("ray://nohost.invalid", "--address", ray_client=True)  # the pool's: probed on port 10001
