"""Bench part (e) without a GPU: its specs load as real sweep specs, its child runner reports failures, and
the whole part runs against a stub runner that plays the three programs (results, JSON summaries)."""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.inputs.spec_file import load_spec
from benchmarks.common import Bench, run_process, sweep_spec, write_prompts
from benchmarks.whole_process import E2EConfig, EndToEnd

WALL = {"jobs.sweep": 10.0, "benchmarks.plain_vllm": 20.0, "benchmarks.ray_data_llm": 30.0}  # stub seconds per program


def test_sweep_spec_is_a_valid_greedy_spec(tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", ["a b", "c d e"])
    raw = sweep_spec("e_x", tmp_path / "out", [("tiny", "/m/tiny"), ("small", "/m/small")], [("t", data)],
                     {"max_model_len": 4096}, 64, {"count": 1, "num_gpus": 0.5})
    (tmp_path / "s.yaml").write_text(json.dumps(raw))
    spec = load_spec(tmp_path / "s.yaml")
    assert [(m.name, m.backend, m.engine) for m in spec.models] == [
        ("tiny", "vllm", {"max_model_len": 4096}), ("small", "vllm", {"max_model_len": 4096})]
    task = spec.tasks[0]
    assert (task.sampling.max_tokens, task.sampling.temperature, task.sampling.stop) == (64, 0, ())
    assert (task.id_column, task.chunked_prefill, spec.shards.max_samples) == ("id", "off", 256)
    assert (spec.actors.count, spec.actors.num_gpus) == (1, 0.5)


def test_config_rejects_unknown_variant_and_non_string_env():
    with pytest.raises(ValueError, match="e_variants"):
        E2EConfig(variants=("raysweep", "vllm_serve"))
    with pytest.raises(ValueError, match="e_raysweep_env"):
        E2EConfig(raysweep_env={"raysweep_inproc": {"RAYSWEEP_VLLM_CORE": 1}})


def test_run_process_raises_with_stderr_tail(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('engine died', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited 3(.|\n)*engine died"):
        run_process(argv, {}, tmp_path / "child")
    wall, out = run_process([sys.executable, "-c", "import os; print(os.environ['X'])"], {"X": "y"}, tmp_path / "ok")
    assert out == "y\n" and wall > 0


class StubRunner:
    """Plays the three programs: writes a sweep's results and manifest, or prints a script's summary."""

    def __init__(self, short_by: int = 0):
        self.calls, self.short_by, self.engines = [], short_by, {}

    def __call__(self, argv, env, stem):
        module = argv[2]
        self.calls.append((stem.name, env))
        if module == "jobs.sweep":
            spec = load_spec(argv[3])
            output = Path(argv[argv.index("--output") + 1])
            for m in spec.models:
                for t in spec.tasks:
                    n = sum(1 for _ in open(spec.data_path(t))) - self.short_by
                    folder = output / "results" / f"model={m.name}" / f"task={t.name}"
                    folder.mkdir(parents=True)
                    pq.write_table(pa.table({"output_tokens": pa.array([3] * n, pa.int32())}), folder / "shard-00000.parquet")
            (output / "manifest.json").write_text(json.dumps({"shards": {}, "runs": [{"ray_start_s": 1.5}]}))
            return WALL[module], ""
        engine = json.loads(argv[argv.index("--engine-args") + 1])
        self.engines[stem.name] = engine
        assert engine["model"] == argv[argv.index("--model") + 1] and not engine.get("enable_chunked_prefill")
        n = sum(1 for _ in open(argv[argv.index("--prompts") + 1]))
        return WALL[module], f"some log line\n{json.dumps({'outputs': n, 'output_tokens': 2 * n})}\n"


def bench_at(tmp_path) -> Bench:
    bench = Bench("/models/small", tmp_path, n_prompts=1)
    bench.rows.clear()
    return bench


def test_part_e_times_each_variant_after_one_warm_up_and_records_ratios(tmp_path):
    bench, runner = bench_at(tmp_path), StubRunner()
    config = E2EConfig(sizes=(6, 10), models=("builtin:tiny", "builtin:small"),
                       raysweep_env={"raysweep_inproc": {"RAYSWEEP_VLLM_CORE": "inprocess"}})
    EndToEnd(bench, config, runner=runner, resolve=lambda p: "/models/" + p.split(":")[1]).run()
    values = {r["metric"]: r["value"] for r in bench.rows}
    names = [name for name, _ in runner.calls]
    assert names.count("e_plain_warm") == names.count("e_raysweep_inproc_warm") == 1
    assert names.count("e_multi_plain_tiny_warm") == names.count("e_multi_plain_small_warm") == 1
    assert all(env == {"RAYSWEEP_VLLM_CORE": "inprocess"} for name, env in runner.calls if "raysweep" in name)
    for n in (6, 10):
        assert values[f"RATIO plain/raysweep_inproc n{n}"] == pytest.approx(2.0)
        assert values[f"RATIO ray_data/raysweep_inproc n{n}"] == pytest.approx(3.0)
        assert values[f"raysweep_inproc n{n} output_tokens"] == 3 * n
        assert values[f"plain n{n} output_tokens"] == 2 * n
        assert values[f"raysweep_inproc n{n} ray_start_s"] == 1.5
    assert values["multi_plain_sum n6 wall_s"] == pytest.approx(40.0)  # two models, 20 s each
    assert values["RATIO multi plain_sum/raysweep_inproc n6"] == pytest.approx(4.0)
    assert values["multi_raysweep_inproc n6 output_tokens"] == 3 * 2 * 6  # both models, both tasks


def test_part_e_fails_when_a_run_misses_outputs(tmp_path):
    config = E2EConfig(sizes=(4,), variants=("raysweep",))
    with pytest.raises(RuntimeError, match="255 outputs for 256 prompts"):
        EndToEnd(bench_at(tmp_path), config, runner=StubRunner(short_by=1), resolve=str).run()


def test_the_plain_scripts_summary_is_found_under_vllms_shutdown_logs():
    from benchmarks.common import summary_line

    stdout = ('INFO 11-22 08:34:17 [api_utils.py:273] non-default args: {"a": 1}\n'
              '{"outputs": 3, "output_tokens": 9, "import_s": 1.0}\n'
              '{not json\n(EngineCore pid=1) INFO [core.py:1313] [shutdown] EngineCore: trigger received\n')
    assert summary_line(stdout) == {"outputs": 3, "output_tokens": 9, "import_s": 1.0}
    assert summary_line('INFO starting\n{"other": 1}\n') is None


def test_a_raysweep_variant_can_have_its_own_actors(tmp_path):
    runner = StubRunner()
    config = E2EConfig(sizes=(6,), variants=("raysweep",),
                       raysweep_env={"raysweep": {}, "raysweep_two": {}},
                       raysweep_actors={"raysweep_two": {"count": 2, "num_gpus": 0.5}})
    EndToEnd(bench_at(tmp_path), config, runner=runner, resolve=str).run()
    actors = {name: load_spec(tmp_path / f"{name}.yaml").actors for name in ("e_raysweep_n6", "e_raysweep_two_n6")}
    assert (actors["e_raysweep_n6"].count, actors["e_raysweep_n6"].num_gpus) == (1, 1)
    assert (actors["e_raysweep_two_n6"].count, actors["e_raysweep_two_n6"].num_gpus) == (2, 0.5)
    with pytest.raises(ValueError, match="e_raysweep_actors"):
        E2EConfig(raysweep_actors={"raysweep_nope": {"count": 2}})


def test_raysweeps_figures_say_when_its_engines_were_built_and_ready_after_the_command_started(tmp_path):
    """The figures set beside the plain script's `import_s + init_s`: the last engine's `built_at` and `ready_at`,
    in seconds after the command started (the manifest's last run), each start's values read from
    telemetry/actors.parquet."""
    from datetime import datetime, timedelta, timezone

    from benchmarks.whole_process import raysweep_figures

    start = datetime(2026, 11, 29, 6, 0, tzinfo=timezone.utc)
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {}, "runs": [{"started_at": start.isoformat(),
                                                                                 "ray_start_s": 19.5}]}))
    (tmp_path / "telemetry").mkdir()
    at = [start + timedelta(seconds=s) for s in (56.0, 58.5, 60.0, 61.0)]
    pq.write_table(pa.table({"built_at": [at[0], at[1]], "ready_at": [at[2], at[3]],
                             "engine_init_s": [31.0, 33.5], "weights_s": [7.9, 8.1],
                             "compile_s": pa.array([None, None], pa.float64())}),
                   tmp_path / "telemetry" / "actors.parquet")
    figures = {name: value for name, (value, _) in raysweep_figures(tmp_path).items()}
    assert figures["engines_built_after_start_s"] == pytest.approx(58.5)
    assert figures["engines_ready_after_start_s"] == pytest.approx(61.0)
    assert figures["ray_start_s"] == 19.5 and figures["actor_engine_init_s_max"] == 33.5
    assert figures["actor_weights_s_median"] == pytest.approx(8.0)
    assert not any(name.startswith("actor_compile_s") for name in figures)  # none measured: no figure
