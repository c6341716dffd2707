"""A structured spec that compiled against a tokenizer's files is not compiled again (cluster/inputs/grammar_cache.py):
planning the same sweep again imports neither xgrammar nor torch; a spec that does not compile is refused on every
run; another tokenizer, or another spec, is compiled."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import QUICKSTART, ROOT

LOAD = """
import sys
from cluster.contracts.errors import PreflightError
from cluster.inputs.spec_file import load_spec
from cluster.plan.plan_source import load_models
try:
    load_models(load_spec(sys.argv[1]))
    print("loaded", "xgrammar" in sys.modules, "torch" in sys.modules)
except PreflightError as e:
    print("refused", e)
"""


def _spec(folder, model_path: str, structured: dict, name: str = "s") -> str:
    spec = {"name": name, "output": str(folder / "out"), "models": [{"name": "m", "path": model_path}],
            "tasks": [{"name": "choice", "data": str(QUICKSTART.parent / "data" / "choice.jsonl"),
                       "prompt": "{question}", "target": "answer", "structured": structured}]}
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return str(path)


def _load(spec: str, cache) -> str:
    """The models of `spec` loaded and checked in a new process, its cache in `cache`: what it printed."""
    done = subprocess.run([sys.executable, "-c", LOAD, spec], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"RAYSWEEP_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.slow
def test_a_spec_compiled_before_is_not_compiled_again_and_one_that_fails_fails_every_time(tmp_path, tiny_path):
    cache = tmp_path / "cache"
    choice = _spec(tmp_path, tiny_path, {"choice": ["A", "B", "C", "D"]})
    assert _load(choice, cache) == "loaded True True"  # compiled: xgrammar, and the torch it loads, imported
    assert _load(choice, cache) == "loaded False False"  # compiled before against these files: neither
    # a regex Python compiles and xgrammar does not (a backreference): refused each time, never taken as compiled
    backref = _spec(tmp_path, tiny_path, {"regex": r"(a)\1"}, name="backref")
    for _ in range(2):
        said = _load(backref, cache)
        assert said.startswith(f"refused {backref}: tasks.choice.structured: does not compile for model m: "), said
        assert "Backreference" in said, said
    # another spec against the same tokenizer is compiled
    assert _load(_spec(tmp_path, tiny_path, {"regex": "[ABCD]"}, name="regex"), cache) == "loaded True True"
    # the same spec against another tokenizer's files is compiled: a copy of the model, its tokenizer.json written
    # again with other whitespace (the cache knows a tokenizer by its files' bytes)
    other = tmp_path / "other-model"
    subprocess.run(["cp", "-r", tiny_path, str(other)], check=True)
    (other / "tokenizer.json").write_text(json.dumps(json.loads((other / "tokenizer.json").read_text()), indent=1))
    assert _load(_spec(tmp_path, str(other), {"choice": ["A", "B", "C", "D"]}, name="other"), cache) == \
        "loaded True True"
