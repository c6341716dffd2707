"""A model change to another checkpoint of the same model keeps the engine and loads the checkpoint's weights into
it (actors/weight_swap.py): the rows it gives are those of the checkpoint run alone, and anything else that
differs (settings, config.json, the tokenizer's files, an engine that cannot) gets a new engine, with the reason."""

import dataclasses
import json
import shutil
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from actors.weight_swap import why_not_swapped
from cluster.contracts.spec import ModelSpec


def checkpoint(tiny_path: str, folder, seed: int | None = None):
    """A copy of the built-in tiny model; with `seed`, other weights of the same shape (another checkpoint)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(tiny_path, folder)
    if seed is not None:
        rng = np.random.default_rng(seed)
        weights = load_file(folder / "model.safetensors")
        save_file({name: (w + rng.normal(0, 0.05, w.shape)).astype(w.dtype) for name, w in weights.items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_only_another_checkpoint_of_the_same_model_keeps_the_engine(tiny_path, tmp_path, monkeypatch):
    a, b = checkpoint(tiny_path, tmp_path / "a"), checkpoint(tiny_path, tmp_path / "b", seed=1)
    first, second = ModelSpec("a", str(a), "hf"), ModelSpec("b", str(b), "hf")
    assert why_not_swapped("hf", first, str(a), second, str(b)) is None
    monkeypatch.delenv("RAYSWEEP_WEIGHT_SWAP", raising=False)
    assert why_not_swapped("vllm", first, str(a), second, str(b)) is None
    monkeypatch.setenv("RAYSWEEP_WEIGHT_SWAP", "0")
    assert why_not_swapped("vllm", first, str(a), second, str(b)) == "RAYSWEEP_WEIGHT_SWAP=0 is set"
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "RAYSWEEP_WEIGHT_SWAP=0 is set"
    monkeypatch.delenv("RAYSWEEP_WEIGHT_SWAP")
    assert why_not_swapped("fake", first, str(a), second, str(b)) == "the fake engine does not load another " \
                                                                      "checkpoint's weights"
    other = dataclasses.replace(second, engine={"max_num_seqs": 8})
    assert why_not_swapped("hf", first, str(a), other, str(b)) == "its settings in the spec differ"

    config = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**config, "_name_or_path": "b", "transformers_version": "9"}))
    assert why_not_swapped("hf", first, str(a), second, str(b)) is None  # names and versions are not the model
    (b / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "its config.json differs"
    (b / "config.json").write_text(json.dumps(config))
    (b / "generation_config.json").write_text("{}")
    (b / "tokenizer_config.json").write_text("{}")
    assert why_not_swapped("hf", first, str(a), second, str(b)) == \
        "its tokenizer_config.json, generation_config.json differ"
    (b / "generation_config.json").write_text((a / "generation_config.json").read_text())
    (b / "tokenizer_config.json").write_text((a / "tokenizer_config.json").read_text())
    (b / "modeling_mine.py").write_text("# a trust_remote_code model's own code\n")
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "its modeling_mine.py differs"
    assert why_not_swapped("hf", first, str(a), second, str(tmp_path / "nowhere")) == "no local config.json to compare"
    (b / "modeling_mine.py").unlink()


def test_a_checkpoint_whose_weight_files_hold_other_tensors_gets_a_new_engine(tiny_path, tmp_path):
    """vLLM's reload keeps the running model's tensor where a checkpoint lacks one (a new engine refuses such a
    checkpoint): only folders whose safetensors files hold the same tensors, names and shapes, are swapped."""
    from safetensors.numpy import load_file, save_file

    a, b = checkpoint(tiny_path, tmp_path / "a"), checkpoint(tiny_path, tmp_path / "b", seed=1)
    first, second = ModelSpec("a", str(a), "hf"), ModelSpec("b", str(b), "hf")
    weights = load_file(b / "model.safetensors")
    (b / "model.safetensors").unlink()
    names = sorted(weights)
    save_file({n: weights[n] for n in names[:2]}, str(b / "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[2:]}, str(b / "model-00002-of-00002.safetensors"))
    assert why_not_swapped("hf", first, str(a), second, str(b)) is None  # the same tensors in other files
    save_file({n: weights[n] for n in names[2:-1]}, str(b / "model-00002-of-00002.safetensors"))
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "its weight tensors differ"
    last = weights[names[-1]]
    save_file({**{n: weights[n] for n in names[2:-1]}, names[-1]: last[..., :1]},
              str(b / "model-00002-of-00002.safetensors"))
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "its weight tensors differ"  # a shape
    for path in b.glob("*.safetensors"):
        path.unlink()
    (b / "pytorch_model.bin").write_bytes(b"not read")
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "no safetensors weights to compare"
    (b / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")  # a header length past the file
    assert why_not_swapped("hf", first, str(a), second, str(b)) == "no safetensors weights to compare"


def test_checkpoints_of_one_model_are_one_family_and_other_settings_or_files_another(tiny_path, tmp_path):
    """The scheduler's side of the same question (cluster/contracts/checkpoint.py family): one digest for the
    checkpoints of one model with the same settings."""
    from cluster.contracts.checkpoint import family

    a, b = checkpoint(tiny_path, tmp_path / "a"), checkpoint(tiny_path, tmp_path / "b", seed=1)
    first, second = ModelSpec("a", str(a), "hf"), ModelSpec("b", str(b), "hf")
    assert family(first, str(a)) == family(second, str(b)) is not None
    assert family(dataclasses.replace(second, engine={"max_num_seqs": 8}), str(b)) != family(first, str(a))
    (b / "generation_config.json").write_text("{}")
    assert family(second, str(b)) != family(first, str(a))
    assert family(second, str(tmp_path / "nowhere")) is None


def test_a_swap_that_raises_fails_the_start_and_closes_the_engine(tiny_path, tmp_path, monkeypatch):
    """The actor's own engine (no Ray): a swap that raised fails the start with an error naming both models and
    the cause (the driver's one line), and the engine, whose weights are neither model's, is closed; the model's
    next start builds a new engine, and the next checkpoint after it is swapped in again; with
    RAYSWEEP_WEIGHT_SWAP=0 in the actor's environment the next one builds a new engine."""
    from actors.evaluator import EvalActor

    a, b = checkpoint(tiny_path, tmp_path / "a"), checkpoint(tiny_path, tmp_path / "b", seed=1)
    actor = EvalActor(time.time(), backends=("hf",))
    try:
        assert actor.start_engine(ModelSpec("a", str(a), "hf"), str(a), time.time())["reason"] == "first"
        engine = actor.engine

        def broken(model_path: str) -> dict:
            raise OSError("the disk went away")

        engine.swap_weights = broken
        with pytest.raises(RuntimeError, match=r"^the weights of model b could not be loaded into the running engine "
                                               r"of model a \(OSError: the disk went away\)$"):
            actor.start_engine(ModelSpec("b", str(b), "hf"), str(b), time.time())
        assert actor.engine is None and engine.engine.model is None  # closed
        row = actor.start_engine(ModelSpec("b", str(b), "hf"), str(b), time.time())
        assert (row["reason"], row["model"], row["model_change"], row["start_index"]) == ("model", "b", 1, 1)
        row = actor.start_engine(ModelSpec("a", str(a), "hf"), str(a), time.time())
        assert (row["reason"], row["model"], row["model_change"], row["start_index"]) == ("weights", "a", 2, 2)
        assert row["engine_init_s"] is None and row["weights_s"] > 0 and row["max_num_seqs"] == 32
        monkeypatch.setenv("RAYSWEEP_WEIGHT_SWAP", "0")
        row = actor.start_engine(ModelSpec("b", str(b), "hf"), str(b), time.time())
        assert (row["reason"], row["model"], row["start_index"]) == ("model", "b", 3) and row["engine_init_s"] > 0
    finally:
        actor.close()


def _spec(tmp_path, name: str, models: list[tuple[str, str]]):
    """Greedy generation and a multiple-choice task, each of 12 rows in shards of 6, on one actor that holds
    the whole local Ray (two CPUs): the models run one after another on it."""
    data = [{"id": f"s{i}", "text": f"sample number {i} says", "choices": [" yes", " no", " maybe"], "label": i % 3}
            for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name, "output": str(tmp_path / name),
        "models": [{"name": model, "path": path, "engine": {"backend": "hf"}} for model, path in models],
        "tasks": [{"name": "gen", "data": "d.jsonl", "id_column": "id", "prompt": "{text}",
                   "sampling": {"max_tokens": 8}},
                  {"name": "mc", "type": "loglikelihood", "data": "d.jsonl", "id_column": "id",
                   "prompt": "{text}:", "choices": "choices", "target": "label"}],
        "shards": {"max_samples": 6}, "actors": {"count": 1, "num_cpus": 2}}))
    from cluster.inputs.spec_file import load_spec

    return load_spec(tmp_path / f"{name}.yaml")


def _rows(out, model: str) -> dict:
    rows = pq.read_table(out / "results").to_pylist()
    return {(r["task"], r["sample_id"]): (r["output_text"], r["choice_logprobs"]) for r in rows if r["model"] == model}


@pytest.mark.slow
def test_a_checkpoint_after_another_on_one_engine_gives_its_own_rows(engine_host, ray_local, tiny_path, tmp_path):
    from cluster.schedule.run import run_sweep

    paths = {"a": checkpoint(tiny_path, tmp_path / "ckpt-a"), "b": checkpoint(tiny_path, tmp_path / "ckpt-b", seed=1)}
    lines: list[str] = []
    report = run_sweep(_spec(tmp_path, "both", [(name, str(path)) for name, path in paths.items()]), engine_host=engine_host,
                       log=lines.append)
    assert not report.failed and report.samples == 48 and report.model_changes == 1, lines
    starts = pq.read_table(tmp_path / "both" / "telemetry" / "actors.parquet").to_pandas()
    assert list(starts["reason"]) == ["first", "weights"] and starts["actor_id"].nunique() == 1, starts
    swap = starts.iloc[1]
    assert swap["weights_s"] > 0 and swap["engine_init_s"] != swap["engine_init_s"]  # NaN: no engine was built
    assert swap["model_change"] == 1 and swap["start_index"] == 1
    said = [line for line in lines if "weights loaded" in line]
    assert len(said) == 1 and said[0].startswith(f"[raysweep] weights loaded: model {swap['model']} into the "
                                                 "running hf engine on actor"), lines

    first, second = starts["model"]  # the models in the order the actor ran them
    run_sweep(_spec(tmp_path, "alone", [(second, str(paths[second]))]), engine_host=engine_host, log=lambda line: None)
    alone = _rows(tmp_path / "alone", second)
    assert _rows(tmp_path / "both", second) == alone and len(alone) == 24  # the checkpoint's own rows, each one
    assert _rows(tmp_path / "both", first) != alone  # which the first checkpoint's engine does not give


@pytest.mark.slow
def test_a_checkpoint_whose_weights_cannot_be_loaded_fails_alone(engine_host, ray_local, tiny_path, tmp_path):
    """Its swap raised (its file's tensors are those of the running model, its data cut short): the start failed
    with the swap's error, in the driver's words for an engine that could not start, and that checkpoint's shards
    fail with it; the other's rows are all there."""
    from cluster.schedule.run import run_sweep

    good, bad = checkpoint(tiny_path, tmp_path / "good"), checkpoint(tiny_path, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()  # its header whole (the same tensors), its data cut short
    (bad / "model.safetensors").write_bytes(data[:8 + int.from_bytes(data[:8], "little") + 64])
    lines: list[str] = []
    report = run_sweep(_spec(tmp_path, "one-bad", [("good", str(good)), ("bad", str(bad))]), engine_host=engine_host,
                       log=lines.append)
    assert len(_rows(tmp_path / "one-bad", "good")) == 24
    assert not _rows(tmp_path / "one-bad", "bad") and sorted(report.failed) == [
        "bad/gen/00000", "bad/gen/00001", "bad/mc/00000", "bad/mc/00001"], lines
    assert all(f["errors"][-1].startswith("engine did not start: RuntimeError: the weights of model bad could not be "
                                          "loaded into the running engine of model good (SafetensorError")
               for f in report.failed.values()), report.failed
    starts = pq.read_table(tmp_path / "one-bad" / "telemetry" / "actors.parquet").to_pandas()
    assert list(starts["reason"]) == ["first"] and list(starts["model"]) == ["good"]
