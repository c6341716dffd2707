"""actors/vllm_registry.py off a GPU machine: where it cannot inspect a model's class in this process (no config.json
to name it, no vLLM), it says so by returning [] and leaves vLLM to its own way; the inspection itself is a GPU test
(tests/test_gpu.py, vLLM installed)."""

import importlib.util
import json

import pytest

from actors.vllm_registry import inspect_here


def test_a_model_folder_without_config_json_is_left_to_vllm(tmp_path):
    assert inspect_here(str(tmp_path)) == []
    assert inspect_here(str(tmp_path / "not-there")) == []  # a hub id, say
    (tmp_path / "config.json").write_text("[1, 2]")  # not an object: no architectures to name
    assert inspect_here(str(tmp_path)) == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed: tests/test_gpu.py covers it")
def test_without_vllm_nothing_is_inspected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert inspect_here(str(tmp_path)) == []


def test_a_registry_not_as_vllm_026_has_it_is_said_in_one_line_and_left_to_vllm(tmp_path, monkeypatch, capsys):
    import sys
    import types

    registry = types.ModuleType("vllm.model_executor.models.registry")  # a stand-in: neither of 0.26's names
    models = types.ModuleType("vllm.model_executor.models")
    models.registry = registry
    plugins = types.ModuleType("vllm.plugins")
    plugins.load_general_plugins = lambda: None
    for name, module in {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("x"),
                         "vllm.model_executor.models": models, "vllm.model_executor.models.registry": registry,
                         "vllm.plugins": plugins}.items():
        monkeypatch.setitem(sys.modules, name, module)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert inspect_here(str(tmp_path)) == []
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("[raysweep] vLLM's model registry is not as vLLM 0.26 has it")
    assert "['LlamaForCausalLM'] in a process of its own" in said[0]
