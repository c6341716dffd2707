"""Engines per GPU and actors per model, chosen where the spec leaves them out
(cluster/plan/engines_per_gpu.py): from the cluster's GPUs, their memory and the models' weights; a value the
spec gives is kept."""

from dataclasses import replace

import pytest

from cluster.contracts.spec import ActorSpec, ModelSpec, SweepSpec
from cluster.plan.engines_per_gpu import choose, model_weights, resolved
from tests.conftest import QUICKSTART

H100 = {"CPU": 16.0, "GPU": 1.0, "accelerator_type:H100": 1.0}
GIB = 1 << 30


def _spec(models: dict[str, str], actors: dict | None = None, engine: dict | None = None) -> SweepSpec:
    from cluster.inputs.spec_file import load_spec

    base = load_spec(QUICKSTART)
    return SweepSpec(name="s", output="out", models=tuple(ModelSpec(name=n, path=p, engine=engine or {})
                                                          for n, p in models.items()),
                     tasks=base.tasks[:1], actors=ActorSpec(**(actors or {})), base_dir=base.base_dir)


@pytest.mark.parametrize("model, per_gpu", [("builtin:tiny", 2), ("builtin:small", 2), ("builtin:medium", 2),
                                            ("builtin:large", 1)])
def test_a_small_model_gets_two_engines_per_gpu_on_an_h100_and_a_large_one_one(model, per_gpu):
    spec = _spec({"m": model})
    choice = choose(spec, H100, model_weights(spec))
    assert (choice.engines_per_gpu, choice.count, choice.num_gpus) == (per_gpu, per_gpu, 1 / per_gpu)
    assert choice.reason.startswith("two engines per GPU" if per_gpu == 2 else "one engine per GPU: model m's weights")
    assert choice.reason.endswith(f"; {per_gpu} actor(s) per model for 1 GPU(s)")
    again = resolved(spec, choice)
    assert (again.actors.count, again.actors.num_gpus) == (per_gpu, 1 / per_gpu)
    assert again.digest() == spec.digest()  # placement never changes what a resume checks


def _loglikelihood(spec: SweepSpec) -> SweepSpec:
    """`spec` with log-likelihoods asked of its models (their engines start compiled, as lm-eval's do)."""
    return replace(spec, models=tuple(replace(m, loglikelihood=True) for m in spec.models))


def test_the_largest_model_decides_and_every_gpu_of_the_cluster_is_used():
    spec = _loglikelihood(_spec({"a": "builtin:small", "b": "builtin:large"}))
    assert choose(spec, H100 | {"GPU": 4.0}, model_weights(spec)).record() == {
        "count": 4, "num_gpus": 1.0, "engines_per_gpu": 1,
        "reason": "one engine per GPU: model b's weights take 13.0 GiB, over 2 GiB, and two engines would keep 17 GiB "
                  "each for their KV cache on a H100 (under 40 GiB); 4 actor(s) per model for 4 GPU(s)"}
    small = _spec({"a": "builtin:small"})
    assert choose(small, H100 | {"GPU": 4.0}, model_weights(small)).count == 8


def test_a_large_model_whose_engines_start_compiled_gets_two_engines_per_gpu_where_each_keeps_a_large_kv_cache():
    # 8B on an H200, log-likelihoods asked: each of two compiled engines keeps 44 GiB for its KV cache (they started
    # faster than one compiled engine there)
    spec = _loglikelihood(_spec({"m": "builtin:large"}))
    h200 = {"CPU": 64.0, "GPU": 4.0, "accelerator_type:H200": 4.0}
    assert choose(spec, h200, model_weights(spec)).record() == {
        "count": 8, "num_gpus": 0.5, "engines_per_gpu": 2,
        "reason": "two engines per GPU: model m's weights take 13.0 GiB, and a H200 of 140 GiB leaves each of two "
                  "engines 45 GiB for its KV cache (at least 40 GiB); 8 actor(s) per model for 4 GPU(s)"}
    # a larger model on the same GPU, and the same model on GPUs of 80 GiB: one engine each
    assert choose(spec, h200, {"m": 24 * GIB}).engines_per_gpu == 1
    assert choose(spec, {"CPU": 8.0, "GPU": 1.0, "accelerator_type:A100-80G": 1.0}, model_weights(spec)).engines_per_gpu == 1


@pytest.mark.parametrize("setting", [{}, {"reproducible": True}, {"engine": {"enforce_eager": True}},
                                     {"engine": {"compilation_config": {"mode": 3}}},
                                     {"engine": {"compilation_config": 3}}, {"engine": {"compilation_config": 0}}])
def test_a_large_model_whose_engines_start_uncompiled_gets_one_engine_per_gpu_however_large_the_gpu(setting):
    """A generation sweep's large model starts uncompiled (cluster/contracts/engine_defaults.py starts_uncompiled):
    one engine per GPU, whose batch generates faster than two engines' on one H200. Where the spec or reproducible
    mode decides compilation, the KV cache's rule as for compiled engines."""
    spec = _spec({"m": "builtin:large"}, engine=setting.get("engine"))
    spec = replace(spec, reproducible=setting.get("reproducible", False))
    h200 = {"CPU": 64.0, "GPU": 4.0, "accelerator_type:H200": 4.0}
    choice = choose(spec, h200, model_weights(spec))
    if not setting:
        assert choice.record() == {
            "count": 4, "num_gpus": 1.0, "engines_per_gpu": 1,
            "reason": "one engine per GPU: model m's weights take 13.0 GiB, over 2 GiB, and its engines start "
                      "uncompiled (no log-likelihood asked of it): one engine's batch generates faster than two "
                      "engines' on one GPU; 4 actor(s) per model for 4 GPU(s)"}
    else:
        assert (choice.engines_per_gpu, choice.count) == (2, 8)


def test_a_value_the_spec_gives_is_kept():
    spec = _spec({"m": "builtin:small"}, {"num_gpus": 1})
    choice = choose(spec, H100, model_weights(spec))
    assert (choice.count, choice.num_gpus, choice.reason) == (1, 1, "actors.num_gpus 1 set in the spec; 1 actor(s) "
                                                                     "per model for 1 GPU(s)")
    spec = _spec({"m": "builtin:small"}, {"num_gpus": 0.25})  # the count is chosen around the given share
    choice = choose(spec, H100 | {"GPU": 4.0}, model_weights(spec))
    assert (choice.count, choice.num_gpus, choice.engines_per_gpu) == (16, 0.25, 4)
    spec = _spec({"m": "builtin:small"}, {"num_gpus": 0.25, "count": 2})
    assert choose(spec, H100 | {"GPU": 4.0}, model_weights(spec)).count == 2
    spec = _spec({"m": "builtin:small"}, {"num_gpus": 0.3})  # three shares fit a GPU, not 3.33
    assert choose(spec, H100 | {"GPU": 4.0}, model_weights(spec)).count == 12
    spec = _spec({"m": "builtin:small"}, {"num_gpus": 1}, {"tensor_parallel_size": 2})  # an engine of two GPUs
    assert choose(spec, H100 | {"GPU": 4.0}, model_weights(spec)).count == 2
    spec = _spec({"m": "builtin:small"}, {"count": 3})  # the share is chosen around the given count
    choice = choose(spec, H100, model_weights(spec))
    assert (choice.count, choice.num_gpus) == (3, 0.5) and choice.reason.endswith("; 3 actor(s) per model")


@pytest.mark.parametrize("resources, actors, engine, reason", [
    ({"CPU": 2.0}, {}, {}, "no GPU in the cluster: one CPU engine per actor"),
    ({"CPU": 8.0, "GPU": 1.0, "accelerator_type:L4": 1.0}, {}, {}, "one engine per GPU: one L4 has 22 GiB, under 40 GiB"),
    ({"CPU": 8.0, "GPU": 1.0}, {}, {}, "one engine per GPU: the memory of a GPU of unknown type is not known"),
    ({"CPU": 8.0}, {"accelerator_type": "A10G"}, {}, "one engine per GPU: one A10G has 22 GiB"),
    (H100 | {"GPU": 4.0}, {}, {"tensor_parallel_size": 2}, "one engine per GPU: model m's engine spans 2 GPUs; "
                                                            "2 actor(s) per model for 4 GPU(s)"),
])
def test_one_engine_per_gpu_where_sharing_was_not_measured_to_gain(resources, actors, engine, reason):
    spec = _spec({"m": "builtin:small"}, actors, engine)
    choice = choose(spec, resources, model_weights(spec))
    assert choice.engines_per_gpu == 1 and choice.num_gpus == 1.0 and choice.reason.startswith(reason)
    said = choice.reason.rpartition("; ")[2]
    assert choice.count == (int(said.split()[0]) if "actor(s)" in said else 1)


def test_a_model_of_unknown_size_is_not_shared():
    spec = _spec({"m": "builtin:small"})
    choice = choose(spec, H100, {"m": None})
    assert choice.engines_per_gpu == 1 and "model m's size is not known" in choice.reason


def test_specs_made_before_the_choice_keep_their_hash_with_placement():
    """Outputs made before 2026-11-22 recorded a hash over `actors:` at its defaults then (count 1, num_gpus 1)."""
    left_out = _spec({"m": "builtin:small"})
    explicit = _spec({"m": "builtin:small"}, {"count": 1, "num_gpus": 1.0})
    assert left_out.digest(with_placement=True) == explicit.digest(with_placement=True)


@pytest.mark.parametrize("model, gpus, tokens, per_gpu", [
    ("builtin:small", 1, 5248 * 256, 4),  # 1.34M new tokens: four engines ran it 1.11x faster than two (H200)
    ("builtin:small", 1, 1312 * 256, 2),  # 0.34M: two engines were faster than four
    ("builtin:small", 2, 5248 * 256, 4),  # 0.67M per GPU
    ("builtin:small", 4, 10496 * 256, 4),  # 0.67M per GPU: four per GPU ran it 1.18x faster than two (4 x H200)
    ("builtin:small", 4, 1312 * 256 * 4, 2),  # 0.34M per GPU
    ("builtin:small", 1, None, 2),  # the budget not known (the pool's choice): two
    ("builtin:medium", 1, 5248 * 256, 2),  # 1B-shape weights: over 0.5 GiB, four not measured
])
def test_four_engines_per_gpu_for_a_tiny_model_and_a_large_generation_budget(model, gpus, tokens, per_gpu):
    spec = _spec({"m": model})
    choice = choose(spec, H100 | {"GPU": float(gpus)}, model_weights(spec), new_tokens=tokens)
    assert (choice.engines_per_gpu, choice.count, choice.num_gpus) == (per_gpu, per_gpu * gpus, 1 / per_gpu)
    assert choice.reason.startswith("four engines per GPU" if per_gpu == 4 else "two engines per GPU")


def test_the_generation_budget_counts_rows_max_tokens_and_completions_of_generation_tasks(tmp_path):
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.spec_file import load_spec
    from cluster.inputs.data import generation_budget

    data = check_inputs(load_spec(QUICKSTART)).data  # 150 rows x 8 + 100 x 4 + 100 x 96 new tokens at most
    assert generation_budget(data) == 150 * 8 + 100 * 4 + 100 * 96
