"""Spec validation: good specs load; every error names the file and the field."""

import pytest
import yaml

from cluster.contracts.spec import SpecError
from cluster.inputs.spec_file import load_spec
from tests.conftest import QUICKSTART


def write_spec(tmp_path, mutate):
    raw = yaml.safe_load(QUICKSTART.read_text())
    mutate(raw)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_quickstart_loads():
    spec = load_spec(QUICKSTART)
    assert [t.name for t in spec.tasks] == ["arithmetic", "choice", "extract"]
    assert spec.tasks[1].structured.value == ("A", "B", "C", "D")
    assert spec.tasks[0].sampling.stop == ("\n",)
    assert spec.models[0].engine == {"max_num_seqs": 32} and spec.models[0].backend == "auto"


def test_engine_backend_shorthand(tmp_path):
    spec = load_spec(write_spec(tmp_path, lambda r: r["models"][0].update(engine="hf")))
    assert spec.models[0].backend == "hf" and spec.models[0].engine == {}


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r["tasks"][0]["sampling"].update(max_tokens=0), "tasks[0].sampling.max_tokens"),
    (lambda r: r["tasks"][1].update(scorer="f1"), "tasks[1].scorer.f1: unknown scorer"),
    (lambda r: r["tasks"][0].update(temprature=0.5), "tasks[0].temprature: unknown field 'temprature'"),
    (lambda r: r["tasks"][1].update(structured={"choices": ["A"]}),
     "tasks[1].structured.choices: unknown field 'choices' (did you mean 'choice'?)"),
    (lambda r: r["tasks"][1].update(structured={"choice": []}), "tasks[1].structured.choice"),
    (lambda r: r["tasks"][2]["scorer"].update(name="regex_match"), "tasks[2].scorer.fields: not an argument"),
    (lambda r: r["tasks"][0].update(messages="msgs"), "tasks[0].prompt: give exactly one"),
    (lambda r: r["tasks"][0].update(data="a.csv"), "tasks[0].data"),
    (lambda r: r["tasks"][0].pop("target"), "tasks[0].target: scorer numeric_match needs a target"),
    (lambda r: r["tasks"].append(dict(r["tasks"][0])), "tasks: name 'arithmetic' is used twice"),
    (lambda r: r.update(models=[]), "models: at least one model"),
    (lambda r: r["models"][0].update(engine={"backend": "trt"}), "models[0].engine.backend"),
    (lambda r: r["models"][0].update(engine={"max_model_len": -1}), "models[0].engine.max_model_len"),
    (lambda r: r.update(shards={"max_samples": "many"}), "shards.max_samples"),
    (lambda r: r.update(actors={"count": 0}), "actors.count"),
    (lambda r: r.update(actors={"shards_in_flight": 0}), "actors.shards_in_flight"),
    (lambda r: r.update(name="night ly"), "name: 'night ly'"),
    (lambda r: r["tasks"][2].update(length_policy="drop"), "tasks[2].length_policy"),
])
def test_errors_name_file_and_field(tmp_path, mutate, field):
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path, mutate))
    assert str(err.value).startswith(str(tmp_path / "sweep.yaml") + ": ")
    assert field in str(err.value)


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="bad.yaml:2: not valid YAML: expected ',' or ']'"):
        load_spec(bad)
    with pytest.raises(SpecError, match="nope.yaml: no such spec file"):
        load_spec(tmp_path / "nope.yaml")


def test_digest_ignores_output_but_not_sampling(tmp_path):
    a = load_spec(write_spec(tmp_path, lambda r: r.update(output="x")))
    b = load_spec(write_spec(tmp_path, lambda r: r.update(output="y")))
    c = load_spec(write_spec(tmp_path, lambda r: r["tasks"][0]["sampling"].update(max_tokens=9)))
    assert a.digest() == b.digest() != c.digest()


def write_text(tmp_path, text: str):
    path = tmp_path / "sweep.yaml"
    path.write_text(text, encoding="utf-8")
    return path


SMALL = """\
name: small
models:
  - {name: m, path: builtin:tiny}
tasks:
  - name: t
    data: d.jsonl
    prompt: "{q}"
    sampling: {max_tokens: 8}
"""


@pytest.mark.parametrize("old, new, message", [
    # a key given twice, at any level, in block or flow style: PyYAML kept the last one quietly
    ("tasks:", "tasks: []\ntasks:", ":5: not valid YAML: duplicate key 'tasks' (first at line 4)"),
    ("{max_tokens: 8}", "{max_tokens: 8, max_tokens: 4000}", ":8: not valid YAML: duplicate key 'max_tokens' (first at line 8)"),
    ("    data: d.jsonl\n", "    data: d.jsonl\n    data: e.jsonl\n", ":7: not valid YAML: duplicate key 'data' (first at line 6)"),
    ("{name: m,", "{name: m, name: n,", ":3: not valid YAML: duplicate key 'name' (first at line 3)"),
])
def test_duplicate_keys_are_errors_with_their_line(tmp_path, old, new, message):
    load_spec(write_text(tmp_path, SMALL))
    with pytest.raises(SpecError) as err:
        load_spec(write_text(tmp_path, SMALL.replace(old, new, 1)))
    assert str(err.value) == str(tmp_path / "sweep.yaml") + message


def test_merge_keys_may_still_be_overridden(tmp_path):
    text = QUICKSTART.read_text().replace("shards: {max_samples: 50, max_tokens: 65536}",
                                          "base: &b {max_samples: 50, max_tokens: 65536}\nshards: {<<: *b, max_samples: 7}")
    with pytest.raises(SpecError, match="base: unknown field 'base'"):  # merging works; the anchor's key is unknown
        load_spec(write_text(tmp_path, text))


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r["tasks"][0]["sampling"].update(max_tokens=True), "tasks[0].sampling.max_tokens: must be an integer >= 1, got True"),
    (lambda r: r["tasks"][0]["sampling"].update(seed=False), "tasks[0].sampling.seed: must be an integer, got False"),
    (lambda r: r["tasks"][0]["sampling"].update(top_p=True), "tasks[0].sampling.top_p"),
    (lambda r: r["tasks"][0]["sampling"].update(temperature=True), "tasks[0].sampling.temperature"),
    (lambda r: r.update(shards={"max_samples": True}), "shards.max_samples: must be an integer >= 1, got True"),
    (lambda r: r.update(actors={"count": True}), "actors.count"),
    (lambda r: r.update(actors={"num_gpus": True}), "actors.num_gpus"),
    (lambda r: r["models"][0].update(engine={"max_model_len": True}), "models[0].engine.max_model_len"),
    (lambda r: r["tasks"][0].update(chat="yes"), "tasks[0].chat: must be true or false"),
    (lambda r: r["tasks"][0].update(prompt=5), "tasks[0].prompt: must be a string, got 5"),
    (lambda r: r["tasks"][0]["sampling"].update(stop=5), "tasks[0].sampling.stop"),
])
def test_booleans_are_not_numbers_nor_numbers_text(tmp_path, mutate, field):
    """YAML reads `yes` as true, and bool is an int in Python: `max_tokens: yes` once became 1."""
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path, mutate))
    assert field in str(err.value)


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["tasks"][0].update(promt=r["tasks"][0].pop("prompt")),
     "tasks[0].promt: unknown field 'promt' (did you mean 'prompt'?)"),
    (lambda r: r.update(taks=r.pop("tasks")), "taks: unknown field 'taks' (did you mean 'tasks'?)"),
    (lambda r: r["models"][0].update(pth=r["models"][0].pop("path")), "models[0].pth: unknown field 'pth' (did you mean 'path'?)"),
    (lambda r: r["tasks"][0]["sampling"].update(max_token=8), "tasks[0].sampling.max_token: unknown field 'max_token' "
                                                              "(did you mean 'max_tokens'?)"),
    (lambda r: r["tasks"][0].update(temperature=0.5), "tasks[0].temperature: unknown field 'temperature' (it belongs under `sampling`)"),
    (lambda r: r.update(shards={"max_sample": 5}), "shards.max_sample: unknown field 'max_sample' (did you mean 'max_samples'?)"),
    (lambda r: r.update(actors={"num_gpu": 1}), "actors.num_gpu: unknown field 'num_gpu' (did you mean 'num_gpus'?)"),
    (lambda r: r["tasks"][1].update(structured={"regx": "A"}), "tasks[1].structured.regx: unknown field 'regx' (did you mean 'regex'?)"),
    (lambda r: r["tasks"][2]["scorer"].update(field=r["tasks"][2]["scorer"].pop("fields")),
     "tasks[2].scorer.field: not an argument of scorer json_match (did you mean 'fields'?)"),
    (lambda r: r["tasks"][0].pop("data"), "tasks[0].data: required"),
    (lambda r: r["models"][0].update(backend="hf"), "models[0].backend: unknown field 'backend' (it belongs under `engine`)"),
])
def test_a_misspelt_key_is_named_with_the_closest_known_one(tmp_path, mutate, message):
    with pytest.raises(SpecError) as err:
        load_spec(write_spec(tmp_path, mutate))
    assert str(err.value) == f"{tmp_path / 'sweep.yaml'}: {message}"


def test_surrogates_in_the_spec(tmp_path):
    """PyYAML keeps a pair of escapes as two code points: joined into one character; a lone one is refused."""
    text = QUICKSTART.read_text()
    spec = load_spec(write_text(tmp_path, text.replace('"You extract facts as JSON."', '"You \\ud83d\\ude00 extract"')))
    assert spec.tasks[2].system == "You \U0001F600 extract"
    with pytest.raises(SpecError) as err:
        load_spec(write_text(tmp_path, text.replace('"You extract facts as JSON."', '"You \\ud800 extract"')))
    assert str(err.value) == f"{tmp_path / 'sweep.yaml'}: tasks[2].system: holds a lone surrogate (\\ud800), which is not text"


def test_relative_paths_are_read_from_the_specs_folder(tmp_path, monkeypatch):
    """One rule, as docker-compose has it: `data:` and `output:` both from the spec file's folder."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    spec = load_spec(write_spec(tmp_path, lambda r: r.update(output="../out/x")))
    assert spec.output_path() == str(tmp_path.parent / "out" / "x")
    assert spec.data_path(spec.tasks[0]) == str(tmp_path / "data" / "arithmetic.jsonl")
    assert load_spec(write_spec(tmp_path, lambda r: r.pop("output"))).output_path() == str(tmp_path / "results" / "quickstart")
    assert load_spec(write_spec(tmp_path, lambda r: r.update(output="s3://b/x"))).output_path() == "s3://b/x"
    assert load_spec(write_spec(tmp_path, lambda r: r.update(output="/abs/x"))).output_path() == "/abs/x"
    models = load_spec(write_spec(tmp_path, lambda r: r.update(models=[
        {"name": "a", "path": "./m"}, {"name": "b", "path": "../m"}, {"name": "c", "path": "org/m"},
        {"name": "d", "path": "/abs/m"}, {"name": "e", "path": "builtin:tiny"}])))
    assert [models.model_path(m) for m in models.models] == [
        str(tmp_path / "m"), str(tmp_path.parent / "m"), "org/m", "/abs/m", "builtin:tiny"]
    # the quickstart's results land in <repo>/results/quickstart, as the README says
    assert load_spec(QUICKSTART).output_path() == str(QUICKSTART.parent.parent / "results" / "quickstart")


def test_an_empty_spec_file_is_said_so(tmp_path):
    with pytest.raises(SpecError, match="sweep.yaml: the spec file is empty"):
        load_spec(write_text(tmp_path, "# nothing\n"))


def test_model_paths_follow_the_data_rule_and_expand_home(tmp_path, monkeypatch, tiny_path):
    """A model path that cannot be a hub id (more than one `/`) or that is a folder beside the spec is read
    from the spec's folder, wherever the command runs; `~` is expanded, as in `data:` and `output:`; a bare
    `org/name` with no such folder beside the spec stays a hub id. find_model reads the same paths."""
    import shutil

    from cluster.inputs.builtin_model import find_model

    home = tmp_path / "home"
    (home / "mymodel").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(f"{tiny_path}/{name}", home / "mymodel" / name)
    shutil.copytree(home / "mymodel", tmp_path / "models" / "org" / "tiny")
    shutil.copytree(home / "mymodel", tmp_path / "acme" / "local")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    spec = load_spec(write_spec(tmp_path, lambda r: r.update(models=[
        {"name": "a", "path": "models/org/tiny"}, {"name": "b", "path": "~/mymodel"},
        {"name": "c", "path": "acme/local"}, {"name": "d", "path": "org/m"}, {"name": "e", "path": "m2/x/y"}])))
    assert [spec.model_path(m) for m in spec.models] == [
        str(tmp_path / "models" / "org" / "tiny"), str(home / "mymodel"), str(tmp_path / "acme" / "local"), "org/m",
        str(tmp_path / "m2" / "x" / "y")]
    for model in spec.models[:3]:
        assert find_model(spec.model_path(model))["max_position_embeddings"] > 0
    assert find_model("~/mymodel")["max_position_embeddings"] > 0  # find_model expands `~` itself too
    with pytest.raises(ValueError, match="no such directory"):
        find_model(spec.model_path(spec.models[4]))


def test_spec_names_and_numbers_are_checked_whole(tmp_path):
    """`$` lets a trailing newline through a name; `.nan` and `.inf` are YAML floats and no setting's value."""
    from cluster.contracts.spec import NAME_RE

    assert NAME_RE.match("tiny\n") is None and NAME_RE.match("tiny")
    for mutate, message in [
        (lambda r: r.update(name="quick\n"), "name: 'quick\\n' must be letters"),
        (lambda r: r["tasks"][0].update(name="arith\n"), "tasks[0].name: 'arith\\n' must be letters"),
        (lambda r: r["models"][0].update(name=7), "models[0].name: 7 is a number in YAML; quote it"),
        (lambda r: r.update(actors={"accelerator_type": "L4\n"}), "actors.accelerator_type: must be a name"),
        (lambda r: r["tasks"][0]["sampling"].update(top_p=float("nan")), "tasks[0].sampling.top_p"),
        (lambda r: r.update(actors={"num_gpus": float("inf")}), "actors.num_gpus: must be >= 0, got inf"),
        (lambda r: r["tasks"][0].update(fail_on_error=float("nan")), "tasks[0].fail_on_error"),
        (lambda r: r.update(output=""), "output: must be a path or a filesystem URI (a string), got ''"),
        (lambda r: r["tasks"][0].update(data="https://example.com/x.jsonl"), "tasks[0].data: 'https://"),
    ]:
        with pytest.raises(SpecError) as err:
            load_spec(write_spec(tmp_path, mutate))
        assert str(err.value).startswith(f"{tmp_path / 'sweep.yaml'}: {message}"), str(err.value)
