"""Spec validation: good specs load; every error names the file and the field."""

import pytest
import yaml

from cluster.spec import SpecError, load_spec
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
    (lambda r: r["tasks"][0].update(temprature=0.5), "tasks[0].temprature: unknown field"),
    (lambda r: r["tasks"][1].update(structured={"choices": ["A"]}), "tasks[1].structured.choices: unknown structured"),
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
    with pytest.raises(SpecError, match="bad.yaml: not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="nope.yaml: no such spec file"):
        load_spec(tmp_path / "nope.yaml")


def test_digest_ignores_output_but_not_sampling(tmp_path):
    a = load_spec(write_spec(tmp_path, lambda r: r.update(output="x")))
    b = load_spec(write_spec(tmp_path, lambda r: r.update(output="y")))
    c = load_spec(write_spec(tmp_path, lambda r: r["tasks"][0]["sampling"].update(max_tokens=9)))
    assert a.digest() == b.digest() != c.digest()
