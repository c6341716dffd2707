"""benchmarks/suite_tasks.py: lm-eval's own task folders over local synthetic documents, the BPE tokenizer and
the model directory, checked with lm-eval's TaskManager and transformers' loaders."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import suite_tasks as st

lm_eval = pytest.importorskip("lm_eval")

FRACTION = 0.02


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    st.write_suite(out, FRACTION)
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    st.write_tokenizer(out)
    return out


def _docs(suite: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (suite / "data" / f"{name}.jsonl").read_text().splitlines()]


def test_split_sizes_are_the_real_ones_times_the_fraction(suite):
    assert sum(t for t, _ in st.MMLU_COUNTS.values()) == 14042
    assert sum(v for _, v in st.MMLU_COUNTS.values()) == 1531
    for subject, (test, validation) in st.MMLU_COUNTS.items():
        assert len(_docs(suite, f"mmlu/{subject}_test")) == max(1, round(test * FRACTION))
        assert len(_docs(suite, f"mmlu/{subject}_validation")) == max(1, round(validation * FRACTION))
        assert len(_docs(suite, f"mmlu/{subject}_dev")) == 5
    expected = {"hellaswag/validation": 201, "hellaswag/train": st.FEWSHOT_POOL, "arc_challenge/test": 23,
                "arc_challenge/validation": 6, "arc_challenge/train": round(1119 * 0.3),
                "winogrande/validation": 25, "winogrande/train": st.FEWSHOT_POOL, "gsm8k/test": 26,
                "gsm8k/train": st.FEWSHOT_POOL}
    assert {name: len(_docs(suite, name)) for name in expected} == expected


def test_records_have_the_real_datasets_fields(suite):
    for doc in _docs(suite, "mmlu/professional_law_test"):
        assert doc.keys() == {"question", "subject", "choices", "answer"} and len(doc["choices"]) == 4
        assert doc["subject"] == "professional_law" and doc["answer"] in range(4)
    for doc in _docs(suite, "hellaswag/validation"):
        assert doc.keys() == {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split",
                              "split_type", "label"}
        assert doc["ctx"] == f"{doc['ctx_a']} {doc['ctx_b']}" and len(doc["endings"]) == 4
        assert doc["label"] in ("0", "1", "2", "3")
    for doc in _docs(suite, "arc_challenge/train"):
        assert doc.keys() == {"id", "question", "choices", "answerKey"}
        assert len(doc["choices"]["text"]) == len(doc["choices"]["label"]) in (3, 4, 5)
        assert doc["answerKey"] in doc["choices"]["label"]
    for doc in _docs(suite, "winogrande/validation"):
        assert doc.keys() == {"sentence", "option1", "option2", "answer"}
        assert doc["sentence"].count("_") == 1 and doc["answer"] in ("1", "2")
    for doc in _docs(suite, "gsm8k/test"):
        steps = re.findall(r"<<(\d+)\*(\d+)=(\d+)>>", doc["answer"])
        assert steps and all(int(a) * int(b) == int(c) for a, b, c in steps)
        assert re.search(r"\n#### \d+$", doc["answer"])


def test_word_lengths_are_near_the_real_datasets(suite):
    def mean_words(name: str, field: str) -> float:
        docs = [d for f in sorted((suite / "data").glob(name)) for d in _docs(suite, str(f.relative_to(
            suite / "data"))[:-6])]
        return sum(len(d[field].split()) for d in docs) / len(docs)

    assert 35 < mean_words("mmlu/*_test.jsonl", "question") < 60
    assert 32 < mean_words("hellaswag/train.jsonl", "ctx") < 48
    assert 17 < mean_words("arc_challenge/train.jsonl", "question") < 28  # the larger splits: steadier means
    assert 15 < mean_words("winogrande/train.jsonl", "sentence") < 25
    assert 35 < mean_words("gsm8k/train.jsonl", "question") < 55


def test_task_yamls_are_lm_evals_with_local_data_appended(suite):
    from lm_eval.tasks._yaml_loader import load_yaml

    source = Path(lm_eval.__file__).parent / "tasks"
    for ours, theirs in (("mmlu_default/mmlu_anatomy.yaml", "mmlu/default/mmlu_anatomy.yaml"),
                         ("hellaswag/hellaswag.yaml", "hellaswag/hellaswag.yaml"),
                         ("arc/arc_challenge.yaml", "arc/arc_challenge.yaml")):
        assert (suite / "tasks" / ours).read_bytes().startswith((source / theirs).read_bytes())
    cfg = load_yaml(suite / "tasks" / "mmlu_default" / "mmlu_anatomy.yaml", resolve_func=False)
    reference = load_yaml(source / "mmlu" / "default" / "mmlu_anatomy.yaml", resolve_func=False)
    assert cfg["dataset_path"] == "json" and cfg["dataset_name"] is None
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(suite / "data" / "mmlu" / "anatomy_test.jsonl")
    assert {k: v for k, v in cfg.items() if not k.startswith("dataset_")} == \
        {k: v for k, v in reference.items() if not k.startswith("dataset_")}
    arc = load_yaml(suite / "tasks" / "arc" / "arc_challenge.yaml", resolve_func=False)
    assert arc["task"] == "arc_challenge" and arc["dataset_kwargs"]["data_files"]["test"].endswith(
        "arc_challenge/test.jsonl")


def test_documents_are_seeded(suite, tmp_path):
    st.write_suite(tmp_path / "again", FRACTION)
    st.write_suite(tmp_path / "other", FRACTION, seed=1)
    for name in ("gsm8k/test", "mmlu/anatomy_dev", "hellaswag/train"):
        assert _docs(suite, name) == _docs(tmp_path / "again", name) != _docs(tmp_path / "other", name)


@pytest.mark.slow
def test_tokenizer_has_the_vocabulary_and_real_like_tokens_per_word(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == 32000 and tok.bos_token == "<|bos|>" and tok.eos_token == "<|end|>"
    text = st.PseudoText(0, 12345).passage(5000) + " Numbers 1234, café."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and ids[0] != tok.bos_token_id
    assert 1.25 < len(ids) / len(text.split()) < 1.5


@pytest.mark.slow
def test_model_directory_has_the_shape_and_the_bpe_vocabulary(tokenizer_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    one = st.write_model(tmp_path / "m1", 1, "tiny", tokenizer_from=tokenizer_dir)
    two = st.write_model(tmp_path / "m2", 2, "tiny", tokenizer_from=tokenizer_dir)
    config = json.loads((one / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(one)
    assert config["vocab_size"] == 32000 and config["hidden_size"] == st.builtin_model.CONFIGS["tiny"]["hidden_size"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert (one / "model.safetensors").read_bytes() != (two / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(one, dtype=torch.float32)
    ids = torch.tensor([tok("Ha ve shot.")["input_ids"]])
    assert model(ids).logits.shape[-1] == 32000
    sharded = st.write_model(tmp_path / "m3", 1, "tiny", tokenizer_from=tokenizer_dir, max_shard_bytes=1 << 20)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1  # transformers reads the index as it does a hub model's
    assert torch.equal(AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)(ids).logits,
                       model(ids).logits)


def test_weights_over_a_shard_are_files_of_at_most_its_size_with_the_index_save_pretrained_writes(tmp_path):
    import numpy as np
    from safetensors import safe_open

    from benchmarks import weight_files

    config = {**st.builtin_model.builtin_config("tiny"), "vocab_size": 512}
    tensors = st.builtin_model.weight_tensors(config, 1, "normal", np.dtype("float32"))
    total = sum(a.nbytes for a in tensors.values())
    files = weight_files.write_weight_files(tmp_path, tensors, total // 3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) >= 3 and [f.name for f in files] == \
        [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(tensors)
    for path in files:
        with safe_open(str(path), "np") as f:
            names = list(f.keys())
            assert all(index["weight_map"][name] == path.name for name in names)
            assert all(np.array_equal(f.get_tensor(name), tensors[name]) for name in names)
            assert len(names) == 1 or sum(tensors[name].nbytes for name in names) <= total // 3
    assert weight_files.has_weights(tmp_path) and not (tmp_path / "model.safetensors").exists()
    whole = tmp_path / "whole"
    whole.mkdir()
    assert weight_files.write_weight_files(whole, tensors, total) == [whole / "model.safetensors"]
    assert weight_files.has_weights(whole)
    assert not (whole / "model.safetensors.index.json").exists() and not weight_files.has_weights(tmp_path / "none")


@pytest.mark.slow
def test_lm_eval_task_manager_takes_the_local_definitions(suite, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a task that fell back to the hub would fail, not download
    manager = TaskManager(include_path=str(suite / "tasks"))
    tasks = manager.load(["hellaswag", "mmlu_abstract_algebra"])["tasks"]
    assert len(list(tasks["hellaswag"].eval_docs)) == 201
    algebra = _docs(suite, "mmlu/abstract_algebra_test")
    for name, task in tasks.items():
        task.set_config(key="num_fewshot", value=2)
        task.set_fewshot_seed(seed=1234)
        task.build_all_requests(limit=1)
        assert task.instances, name
    context = tasks["mmlu_abstract_algebra"].instances[0].args[0]
    assert context.startswith("The following are multiple choice questions (with answers) about abstract algebra.")
    assert algebra[0]["question"].strip() in context and context.endswith("Answer:")
    hellaswag = tasks["hellaswag"].instances[0].args[0]
    first = _docs(suite, "hellaswag/validation")[0]
    assert first["ctx_a"].split()[0] in hellaswag

