"""Bench part (e): whole-process timing of raysweep against the plain ways to run the same work.

Every compared thing is a new Python process, timed with `perf_counter` from just before it is started
to just after it exits (interpreter, imports, Ray, engine start-up, generation, output, shutdown), over
the same prompts, vLLM arguments and sampling (greedy, `max_tokens`, no stop strings):

1. `raysweep`: `python -m jobs.sweep SPEC --output DIR --new-run`, once per `--e-raysweep-env` entry
   (extra environment variables for that run, e.g. RAYSWEEP_VLLM_CORE=spawn).
2. `plain`: `python -m benchmarks.plain_vllm`, one `vllm.LLM(**args).generate(...)`, where `args` are what
   raysweep gives vLLM for a short shard on a whole GPU (`actors.vllm_args.engine_args`).
3. `ray_data`: `python -m benchmarks.ray_data_llm`, Ray Data LLM's vLLM processor with the same arguments.
4. `multi`: several models x two tasks (short and long prompts, the first size split between them) on
   one GPU as one raysweep process, against the plain script once per model over both tasks' prompts,
   one after another (the sum of their times).

Each variant (for `multi`'s plain runs: each model) first runs once untimed over WARM_PROMPTS prompts,
so vLLM's torch.compile cache and the page cache are warm for the timed runs. Builtin models are built
in the bench process before any timing. A run counts only if it exits 0 with one output per prompt.
Logs and command lines of every run are kept in the bench's out folder (`e_*.stdout`, `.stderr`, `.cmd`).
Run through `python -m benchmarks --parts e` (flags --e-*); the child runner and spec are in benchmarks/common.py.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (Runner, count_lines, engine_starts, prompts_of, result_counts, run_process,
                               summary_line, sweep_spec, vllm_args, write_prompts)

VARIANTS = ("raysweep", "plain", "ray_data", "multi")
WARM_PROMPTS = 256  # one shard: every code path runs once, the compile and page caches fill
MANIFEST_FIELDS = ("ray_start_s", "planning_s", "first_result_s", "last_result_s")
TAIL_FIELDS = {"tail_idle_share": "of the actors' GPU-seconds idle at the tail (manifest runs[-1])",
               "tail_idle_gpu_s": "GPU-seconds idle at the tail (manifest runs[-1])",
               "tail_splits": "shards cut at the model's tail (manifest runs[-1])"}
LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class E2EConfig:
    sizes: tuple[int, ...] = (1312, 5248)  # prompts per single-model run; `multi` uses the first
    variants: tuple[str, ...] = VARIANTS
    models: tuple[str, ...] = ("builtin:tiny", "builtin:small", "builtin:medium")  # `multi`'s models
    max_tokens: int = 256
    actors: dict = field(default_factory=lambda: {"count": 1, "num_gpus": 1})  # raysweep's `actors`
    multi_actors: dict = field(default_factory=lambda: {"count": 1, "num_gpus": 1})  # ... in `multi`
    raysweep_env: dict = field(default_factory=lambda: {"raysweep": {}})  # label -> extra env of a run
    raysweep_actors: dict = field(default_factory=dict)  # label -> its own `actors` (else `actors`)
    warm: bool = True  # False: no warm-up runs (an earlier call on the same machine warmed the caches)

    def __post_init__(self) -> None:
        if not self.sizes or not all(isinstance(n, int) and n >= 1 for n in self.sizes):
            raise ValueError(f"e_prompts: prompt counts must be integers >= 1, got {self.sizes!r}")
        if "multi" in self.variants and self.sizes[0] < 2:
            raise ValueError(f"e_prompts: multi splits the first size between two tasks, got {self.sizes[0]}")
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown or not self.variants:
            raise ValueError(f"e_variants: {unknown or 'none given'}; use some of {', '.join(VARIANTS)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"e_max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        names = [model_name(m) for m in self.models]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"e_models: need distinct model names, got {names}")
        for label, env in self.raysweep_env.items():
            if not LABEL_RE.match(label) or not isinstance(env, dict) or \
                    not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise ValueError(f"e_raysweep_env: {label!r} must name a mapping of strings to strings, got {env!r}")
        if not self.raysweep_env:
            raise ValueError("e_raysweep_env: at least one raysweep variant is needed")
        for label, actors in self.raysweep_actors.items():
            if label not in self.raysweep_env or not isinstance(actors, dict):
                raise ValueError(f"e_raysweep_actors: {label!r} must be a variant of e_raysweep_env "
                                 f"({', '.join(self.raysweep_env)}) mapped to an `actors` mapping, got {actors!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("part e (whole-process timing; vLLM arguments: --engine)")
    group.add_argument("--e-prompts", default="1312,5248", help="prompt counts, comma-separated; multi uses the first")
    group.add_argument("--e-variants", default=",".join(VARIANTS), help="which runs, comma-separated")
    group.add_argument("--e-models", default="builtin:tiny,builtin:small,builtin:medium", help="multi's models")
    group.add_argument("--e-max-tokens", type=int, default=256, help="generated tokens at most, per prompt")
    group.add_argument("--e-actors", default='{"count": 1, "num_gpus": 1}', help="raysweep's `actors` (JSON)")
    group.add_argument("--e-multi-actors", default='{"count": 1, "num_gpus": 1}', help="`actors` in multi (JSON)")
    group.add_argument("--e-no-warm", action="store_true",
                       help="skip the untimed warm-up runs: an earlier call on this machine warmed the caches")
    group.add_argument("--e-raysweep-env", default="{}", help="raysweep variants, each run once: JSON "
                       "{label: {ENV: value}}, e.g. '{\"spawn\": {\"RAYSWEEP_VLLM_CORE\": \"spawn\"}}'")
    group.add_argument("--e-raysweep-actors", default="{}", help="`actors` of some raysweep variants: JSON "
                       "{label: actors}, e.g. '{\"two\": {\"count\": 2, \"num_gpus\": 0.5}}' (the others: --e-actors)")


def config_from_args(args: argparse.Namespace) -> E2EConfig:
    envs, actors = json.loads(args.e_raysweep_env), json.loads(args.e_raysweep_actors)
    if not isinstance(envs, dict) or not isinstance(actors, dict):
        raise ValueError(f"e_raysweep_env, e_raysweep_actors: must be JSON objects, got {args.e_raysweep_env!r}, "
                         f"{args.e_raysweep_actors!r}")
    return E2EConfig(sizes=tuple(int(n) for n in args.e_prompts.split(",")),
                     variants=tuple(v.strip() for v in args.e_variants.split(",") if v.strip()),
                     models=tuple(m.strip() for m in args.e_models.split(",") if m.strip()),
                     max_tokens=args.e_max_tokens, actors=json.loads(args.e_actors),
                     multi_actors=json.loads(args.e_multi_actors),
                     raysweep_env={f"raysweep_{k}": v for k, v in envs.items()} or {"raysweep": {}},
                     raysweep_actors={f"raysweep_{k}": v for k, v in actors.items()},
                     warm=not args.e_no_warm)


def model_name(path: str) -> str:
    """A spec-safe model name: `tiny` for builtin:tiny, the folder's name for a path."""
    base = path.split(":", 1)[1] if path.startswith("builtin:") else Path(path.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-._") or "model"


def raysweep_figures(output: Path) -> dict:
    """raysweep's own start-up and progress figures, where it wrote them: manifest `runs[-1]` and the
    median over actors of telemetry/actors.parquet. Absent fields and columns are left out."""
    import pyarrow.parquet as pq

    from cluster.store.manifest import read_manifest

    runs = read_manifest(str(output)).get("runs") or [{}]
    figures = {f: (runs[-1][f], "s (manifest runs[-1])") for f in MANIFEST_FIELDS if runs[-1].get(f) is not None}
    figures.update({f: (runs[-1][f], unit) for f, unit in TAIL_FIELDS.items() if runs[-1].get(f) is not None})
    actors = output / "telemetry" / "actors.parquet"
    table = pq.read_table(actors) if actors.exists() else None
    for column, values in engine_starts(output).items():
        figures[f"actor_{column}_median"] = (statistics.median(values), f"s (median of {len(values)} actors)")
        figures[f"actor_{column}_max"] = (max(values), f"s (the most of {len(values)} actors)")
    if table is not None and "ready_at" in table.column_names:  # engines side by side: first to last ready
        ready = [t for t in table["ready_at"].to_pylist() if t is not None]
        if ready:
            figures["engines_ready_spread_s"] = ((max(ready) - min(ready)).total_seconds(),
                                                 f"s (first to last of {len(ready)} engine starts ready)")
        figures.update(_after_start(table, runs[-1].get("started_at")))
    shards = output / "telemetry" / "shards.parquet"
    if shards.exists():  # first shard's start to last shard's end: comparable to the plain script's generate_s
        times = pq.read_table(shards, columns=["started_at", "finished_at"]).drop_null()
        if times.num_rows:
            span = max(times["finished_at"].to_pylist()) - min(times["started_at"].to_pylist())
            figures["shards_span_s"] = (span.total_seconds(), "s (first shard start to last shard end)")
    return figures


def _after_start(table, started_at: str | None) -> dict:
    """When the engines were built (`built_at`) and ready for their actors (`ready_at`), the last of each, in
    seconds after the command started: against the plain script's `import_s + init_s`."""
    from datetime import datetime

    if started_at is None:
        return {}
    start, figures = datetime.fromisoformat(started_at), {}
    for column in ("built_at", "ready_at"):
        times = [t for t in table[column].to_pylist() if t is not None] if column in table.column_names else []
        if times:
            figures[f"engines_{column[:-3]}_after_start_s"] = (
                (max(times) - start).total_seconds(), f"s (the last of {len(times)} engine starts, {column})")
    return figures


@dataclass
class Finished:
    wall_s: float
    output_tokens: int
    figures: dict = field(default_factory=dict)  # name -> (value, unit)


def _expect(stem: str, got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"{stem}: {got} outputs for {want} prompts")


class EndToEnd:
    """Part (e) for one Bench: figures go to `bench.record`, files to `bench.out`. `runner` starts and times
    a child (`run_process`; tests inject a stub), `resolve` turns builtin:NAME into a model directory."""

    def __init__(self, bench, config: E2EConfig, runner: Runner | None = None, resolve=None):
        from cluster.inputs.builtin_model import resolve_model_path

        self.bench, self.config, self.out = bench, config, Path(bench.out)
        self.runner, self.resolve = runner or run_process, resolve or resolve_model_path
        self.overrides = dict(getattr(bench, "engine_overrides", {}))
        self.warmed: set[str] = set()  # labels whose untimed warm-up has run

    def run(self) -> None:
        # 1. models built and prompt files written before anything is timed
        multi = [(model_name(m), self.resolve(m)) for m in self.config.models if "multi" in self.config.variants]
        warm = write_prompts(self.out / "e_warm.jsonl", prompts_of(WARM_PROMPTS, 64, 1024, seed=10))
        # 2. one model, each size: raysweep (each env variant), the plain script, Ray Data LLM
        if set(self.config.variants) & {"raysweep", "plain", "ray_data"}:
            for size in self.config.sizes:
                self.single(size, warm)
        # 3. several models on one GPU
        if multi:
            self.multi(self.config.sizes[0], multi)

    def single(self, size: int, warm: Path) -> None:
        data = write_prompts(self.out / f"e_n{size}.jsonl", prompts_of(size, 64, 1024, seed=11))
        tag, variants, walls = f"n{size}", self.config.variants, {}
        if "raysweep" in variants:
            for label, env in self.config.raysweep_env.items():
                actors = self.config.raysweep_actors.get(label, self.config.actors)
                run = self.sweep([("m", self.bench.model_path)], env, actors)
                walls[label] = self.measure(label, tag, run, [("t", data)], [("t", warm)])
        for variant, module in (("plain", "benchmarks.plain_vllm"), ("ray_data", "benchmarks.ray_data_llm")):
            if variant in variants:
                run = self.script(module, self.bench.model_path)
                walls[variant] = self.measure(variant, tag, run, [("t", data)], [("t", warm)])
        for label in self.config.raysweep_env:
            for other in ("plain", "ray_data"):
                if label in walls and other in walls:
                    self.bench.record("e", f"RATIO {other}/{label} {tag}", walls[other] / walls[label],
                                      "x (whole-process wall time; above 1: raysweep is faster)")

    def multi(self, size: int, models: list) -> None:
        half, w = size // 2, WARM_PROMPTS // 2
        short, long_ = prompts_of(half, 64, 256, seed=12), prompts_of(size - half, 512, 1024, seed=13)
        sets = {"short": short, "long": long_, "both": short + long_}
        data = {k: write_prompts(self.out / f"e_multi_{k}.jsonl", v) for k, v in sets.items()}
        warm = {k: write_prompts(self.out / f"e_multi_warm_{k}.jsonl", v)
                for k, v in (("short", short[:w]), ("long", long_[:w]), ("both", short[:w] + long_[:w]))}
        tag, tasks = f"n{size}", ("short", "long")
        walls = {label: self.measure(f"multi_{label}", tag, self.sweep(models, env, self.config.multi_actors),
                                     [(t, data[t]) for t in tasks], [(t, warm[t]) for t in tasks])
                 for label, env in self.config.raysweep_env.items()}
        plain_sum = sum(self.measure(f"multi_plain_{name}", tag, self.script("benchmarks.plain_vllm", path),
                                     [("both", data["both"])], [("both", warm["both"])]) for name, path in models)
        self.bench.record("e", f"multi_plain_sum {tag} wall_s", plain_sum,
                          f"s ({len(models)} plain processes, one after another)")
        for label, wall in walls.items():
            self.bench.record("e", f"RATIO multi plain_sum/{label} {tag}", plain_sum / wall,
                              f"x ({len(models)} models x 2 tasks; above 1: raysweep is faster)")

    def measure(self, label: str, tag: str, run, tasks: list, warm_tasks: list) -> float:
        """The timed run of one variant, after its untimed warm-up if it has had none: wall seconds."""
        if self.config.warm and label not in self.warmed:
            warm = run(f"e_{label}_warm", warm_tasks)
            self.warmed.add(label)
            self.bench.record("e", f"{label} warm-up wall_s", warm.wall_s,
                              "s (untimed run before the timed ones: fills the compile and page caches)")
        done = run(f"e_{label}_{tag}", tasks)
        self.bench.record("e", f"{label} {tag} wall_s", done.wall_s, "s (whole process, start to exit)")
        self.bench.record("e", f"{label} {tag} output_tokens", done.output_tokens, "tokens")
        for name, (value, unit) in done.figures.items():
            self.bench.record("e", f"{label} {tag} {name}", value, unit)
        return done.wall_s

    def sweep(self, models: list, env: dict, actors: dict):
        def run(stem: str, tasks: list) -> Finished:
            output, spec = self.out / stem, self.out / f"{stem}.yaml"
            spec.write_text(json.dumps(sweep_spec(stem, output, models, tasks, self.overrides,
                                                  self.config.max_tokens, actors), indent=1))  # JSON is YAML
            wall, _ = self.runner([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(output),
                                   "--new-run"], env, self.out / stem)
            rows, tokens = result_counts(output)
            _expect(stem, rows, len(models) * sum(count_lines(f) for _, f in tasks))
            return Finished(wall, tokens, raysweep_figures(output))
        return run

    def script(self, module: str, model_path: str):
        args = json.dumps(vllm_args(model_path, self.overrides))

        def run(stem: str, tasks: list) -> Finished:
            [(_, prompts)] = tasks  # one prompt file: a script runs one list of prompts
            wall, stdout = self.runner([sys.executable, "-m", module, "--model", model_path, "--prompts",
                                        str(prompts), "--engine-args", args, "--max-tokens",
                                        str(self.config.max_tokens)], {}, self.out / stem)
            summary = summary_line(stdout)
            if summary is None:
                raise RuntimeError(f"{stem}: no JSON summary line on its stdout")
            _expect(stem, summary["outputs"], count_lines(prompts))
            phases = {name: (summary[name], "s (the script's own clock)")
                      for name in ("import_s", "init_s", "generate_s") if summary.get(name) is not None}
            return Finished(wall, summary["output_tokens"], phases)
        return run


def part_e(bench) -> None:
    """Whole-process timing against a plain vLLM script and Ray Data LLM (this module)."""
    EndToEnd(bench, bench.e2e).run()


PARTS = {"e": part_e}
