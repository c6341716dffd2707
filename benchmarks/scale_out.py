"""Bench part (n): one sweep on the N GPUs of one host against the usual ways to spread it, whole processes.

    python -m benchmarks.scale_out --gpus 4 --prompts 10496 --out DIR [--model builtin:small] [--variants ...]
                                   [--engine JSON] [--raysweep-engine JSON] [--tried-engine JSON ...] [--rounds N]
                                   [--tried-actors JSON] [--fresh-caches]

Every variant is timed from just before its first process starts to just after its last one exits, over the
same prompts (`prompts_of(n, 64, 1024, seed=11)`, as part e), greedy, `--max-tokens` new tokens, in one call:
- `plain`: the plain script (benchmarks/plain_vllm.py, raysweep's engine arguments) on one GPU, every prompt;
- `plain_defaults`: the same script given only the model: `LLM(model=PATH)`, vLLM's own defaults for the GPU;
- `split`: the plain script as N processes started together, one GPU and 1/N of the prompts each (a hand split);
- `split_defaults`: the same hand split given only the model, as `plain_defaults`;
- `raysweep_1`: `python -m jobs.sweep` over a spec with no `actors:` section, on the first GPU;
- `raysweep`: the same spec on all N GPUs;
- `raysweep_one`: the same on N GPUs with `actors: {num_gpus: 1}` (one engine per GPU, whatever the rule says);
- `raysweep_two`: the same on N GPUs with `actors: {num_gpus: 0.5}` (two engines per GPU, whatever the rule says);
- `raysweep_four`: the same with `actors: {num_gpus: 0.25}` (four engines per GPU);
- `raysweep_tried`: `raysweep` with `--tried-engine JSON` added to its engine arguments, and `--tried-actors JSON`
  as its `actors:` section where given (a setting tried against raysweep's own choice and the plain script in the
  same rounds); `--tried-engine` given again makes `raysweep_tried2`, `raysweep_tried3`, ... of the second, third;
- `ray_data`: Ray Data LLM (benchmarks/ray_data_llm.py) with `concurrency=N`;
- `lm_eval`: `lm_eval --model vllm --model_args pretrained=PATH,data_parallel_size=N` over a local generate_until
  task of the same prompts (`max_gen_toks`, greedy; lm-eval adds the end-of-text string as its stop).
`--engine JSON` is added to raysweep's model `engine:` and so to the plain script's arguments (not to
`plain_defaults`'s); `--raysweep-engine JSON` to raysweep's alone (a setting of raysweep's tried against the same
plain script). `--rounds N` runs the variants N times in turn (a later round's prints end in `_r2`, ...): each
variant's wall is the median of its rounds, and each round's ratio to `plain_defaults` is said beside the
median's (a host whose plain script moves by seconds between calls), and so is each hand split's over each
raysweep variant's. The GPUs are this process's (the first N of CUDA_VISIBLE_DEVICES where it is set).
Untimed warm-ups first (unless --no-warm), each over WARM_PROMPTS prompts, filling vLLM's compile cache: the
plain script on one GPU (where `plain`, `split` or `ray_data` run), `plain_defaults`, raysweep on one GPU (where
`raysweep_1` runs), each of `raysweep`, `raysweep_one`, `raysweep_two`, `raysweep_four` and the tried variants
that runs with its own actors (the engine arguments of a whole GPU and of a shared one differ, and so do their
compiled graphs), and lm-eval on N GPUs (its own engine arguments). A variant counts only if it exits 0 with one
output per prompt; one that fails is said, the others run, and the call fails at the end. Figures go to
OUT/n.json after each variant (a call cut short keeps those done) and to OUT/bench.parquet; each process's
command and prints are kept beside them (`n_*.cmd`, `.stdout`, `.stderr`).
`--fresh-caches`: each variant's run starts on empty compile and JIT caches of its own (vLLM's, Inductor's,
Triton's, FlashInfer's: benchmarks/common.py `fresh_caches`, under OUT/caches/STEM), shared by its processes, as on
a node the autoscaler has just started; there is then nothing to warm, and no warm-up runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from benchmarks.common import (REPO, Bench, count_lines, fresh_caches, prompts_of, result_counts, run_process,
                               summary_line, sweep_spec, vllm_args, write_prompts)
from benchmarks.whole_process import raysweep_figures

VARIANTS = ("plain", "plain_defaults", "split", "split_defaults", "raysweep", "raysweep_1", "raysweep_one",
            "raysweep_two", "raysweep_four", "raysweep_tried", "lm_eval", "ray_data")
WARM_PROMPTS = 256


class ScaleOut:
    """`runner` starts and times one child (`run_process`), `popen` starts one of the hand split's: tests stub them."""

    def __init__(self, bench: Bench, gpus: int, prompts: int, max_tokens: int, runner=run_process,
                 popen=subprocess.Popen, engine: dict | None = None, raysweep_engine: dict | None = None,
                 rounds: int = 1, tried_engines: list[dict] | None = None, fresh: bool = False,
                 tried_actors: dict | None = None):
        self.bench, self.gpus, self.max_tokens, self.out = bench, gpus, max_tokens, Path(bench.out)
        self.rounds, self.fresh = rounds, fresh
        self.engine = dict(engine or {})
        self.raysweep_engine = {**self.engine, **(raysweep_engine or {})}
        # raysweep_tried, raysweep_tried2, ...: each a setting added to raysweep's engine arguments
        self.tried = {tried_name(k): dict(engine) for k, engine in enumerate(tried_engines or [])}
        self.tried_actors = tried_actors or {}  # the tried variants' `actors:` (default: none, the rule's choice)
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and len(visible) < gpus:
            raise ValueError(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES lists {len(visible)} ({','.join(visible)})")
        self.devices = visible[:gpus] if visible else [str(i) for i in range(gpus)]
        self.runner, self.popen = runner, popen
        texts = prompts_of(prompts, 64, 1024, seed=11)
        self.data = write_prompts(self.out / f"n_n{prompts}.jsonl", texts)
        self.warm = write_prompts(self.out / "n_warm.jsonl", texts[:WARM_PROMPTS])
        self.parts = [write_prompts(self.out / f"n_part{i}.jsonl", texts[i::gpus]) for i in range(gpus)]
        self.figures: dict = {"gpus": gpus, "prompts": prompts, "max_tokens": max_tokens, "engine": self.engine,
                              "raysweep_engine": self.raysweep_engine, "devices": self.devices, "walls": {}}

    # -- the variants -----------------------------------------------------------------------------------
    def plain(self, stem: str, data: Path, engine_args: dict | None = None) -> float:
        """The plain script on the first GPU: raysweep's engine arguments, or `engine_args` as given."""
        wall, stdout = self.runner(self._script("benchmarks.plain_vllm", data, engine_args),
                                   {**self._one_gpu(), **self._caches(stem)}, self.out / stem)
        self._expect(stem, _outputs(stdout, stem), count_lines(data))
        return wall

    def split(self, stem: str, engine_args: dict | None = None) -> float:
        """N plain scripts started together, one GPU each: the wall time of the slowest."""
        caches = self._caches(stem)  # one node's: its processes share them
        children, started = [], time.perf_counter()
        for i, part in enumerate(self.parts):
            path = self.out / f"{stem}_{i}"
            device = self.devices[i]
            env = {"CUDA_VISIBLE_DEVICES": device, **caches}
            argv = self._script("benchmarks.plain_vllm", part, engine_args)
            path.with_name(path.name + ".cmd").write_text(
                " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv) + "\n")
            stdout, stderr = open(f"{path}.stdout", "w"), open(f"{path}.stderr", "w")
            env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
            children.append((self.popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=REPO), path, part))
        codes = [child.wait() for child, _, _ in children]
        wall = time.perf_counter() - started
        for code, (_, path, part) in zip(codes, children):
            if code != 0:
                raise RuntimeError(f"{path.name}: exited {code}: {Path(f'{path}.stderr').read_text()[-2000:]}")
            self._expect(path.name, _outputs(Path(f"{path}.stdout").read_text(), path.name), count_lines(part))
        return wall

    def raysweep(self, stem: str, data: Path, actors: dict, env: dict, tried: dict | None = None) -> float:
        output, spec = self.out / stem, self.out / f"{stem}.yaml"
        engine = {**self.raysweep_engine, **(tried or {})}
        spec.write_text(json.dumps(sweep_spec(stem, output, [("m", self.bench.model_path)], [("t", data)],
                                              engine, self.max_tokens, actors), indent=1))
        wall, _ = self.runner([sys.executable, "-m", "jobs.sweep", str(spec), "--output", str(output), "--new-run"],
                              {**env, **self._caches(stem)}, self.out / stem)
        rows, _tokens = result_counts(output)
        self._expect(stem, rows, count_lines(data))
        self.figures[stem] = {name: value for name, (value, _unit) in raysweep_figures(output).items()}
        from cluster.store.manifest import read_manifest

        self.figures[stem]["engines"] = (read_manifest(str(output)).get("runs") or [{}])[-1].get("engines")
        return wall

    def ray_data(self, stem: str) -> float:
        argv = self._script("benchmarks.ray_data_llm", self.data) + ["--concurrency", str(self.gpus)]
        wall, stdout = self.runner(argv, {**self._all_gpus(), **self._caches(stem)}, self.out / stem)
        self._expect(stem, _outputs(stdout, stem), count_lines(self.data))
        return wall

    def lm_eval(self, stem: str, limit: int | None) -> float:
        tasks = self._lm_eval_task()
        argv = [sys.executable, "-m", "lm_eval", "--model", "vllm", "--model_args",
                f"pretrained={self.bench.model_path},data_parallel_size={self.gpus}", "--tasks", "scale_gen",
                "--include_path", str(tasks), "--batch_size", "auto", "--output_path", str(self.out / stem),
                *(["--limit", str(limit)] if limit else [])]
        wall, _ = self.runner(argv, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **self._all_gpus(),
                                     **self._caches(stem)}, self.out / stem)
        found = sorted((self.out / stem).rglob("results_*.json"))
        if not found:
            raise RuntimeError(f"{stem}: lm_eval wrote no results file")
        counted = json.loads(found[-1].read_text())["n-samples"]["scale_gen"]["effective"]
        self._expect(stem, counted, limit or count_lines(self.data))
        return wall

    # -- the call ---------------------------------------------------------------------------------------
    def run(self, variants: list[str], warm: bool) -> None:
        every = self._all_gpus()
        actors = {"raysweep": {}, "raysweep_one": {"num_gpus": 1}, "raysweep_two": {"num_gpus": 0.5},
                  "raysweep_four": {"num_gpus": 0.25}, **{name: self.tried_actors for name in self.tried}}
        if warm and not self.fresh:  # fresh caches: each run starts on empty ones, nothing to warm
            warm_ups = [(("plain", "split", "ray_data"), "plain", lambda: self.plain("n_warm_plain", self.warm)),
                        (("plain_defaults", "split_defaults"), "plain_defaults",
                         lambda: self.plain("n_warm_plain_defaults", self.warm, self._model_only())),
                        (("raysweep_1",), "raysweep_1",
                         lambda: self.raysweep("n_warm_raysweep_1", self.warm, {}, self._one_gpu()))]
            # each raysweep variant warms its own actors' engines: a whole GPU's engine arguments (vLLM's batch
            # limit) differ from a shared GPU's, and so does what vLLM's compile cache holds for them
            warm_ups += [((name,), name, lambda name=name: self.raysweep(f"n_warm_{name}", self.warm, actors[name],
                                                                           every, self.tried.get(name)))
                         for name in actors]
            warm_ups.append((("lm_eval",), "lm_eval", lambda: self.lm_eval("n_warm_lm_eval", WARM_PROMPTS)))
            for wanted, label, go in warm_ups:
                if set(wanted) & set(variants):
                    self._note(f"warm {label}", go())
        runs = {"plain": lambda r: self.plain(f"n_plain{r}", self.data), "split": lambda r: self.split(f"n_split{r}"),
                "split_defaults": lambda r: self.split(f"n_split_defaults{r}", self._model_only()),
                "plain_defaults": lambda r: self.plain(f"n_plain_defaults{r}", self.data, self._model_only()),
                "raysweep_1": lambda r: self.raysweep(f"n_raysweep_1{r}", self.data, {}, self._one_gpu()),
                "lm_eval": lambda r: self.lm_eval(f"n_lm_eval{r}", None),
                "ray_data": lambda r: self.ray_data(f"n_ray_data{r}"),
                **{name: lambda r, name=name: self.raysweep(f"n_{name}{r}", self.data, actors[name], every,
                                                            self.tried.get(name))
                   for name in actors}}
        rounds: dict[str, list[float]] = {}
        for k in range(1, self.rounds + 1):  # round 1's stems as ever; a later round's end in _r2, _r3, ...
            suffix = "" if k == 1 else f"_r{k}"
            for variant in (v for v in variants if v not in self.figures.get("failed", {})):
                try:
                    rounds.setdefault(variant, []).append(self._note(variant + suffix, runs[variant](suffix)))
                except Exception as e:  # noqa: BLE001  (said, and the next variant runs: one call, many figures)
                    self.figures.setdefault("failed", {})[variant] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"[bench] {variant}{suffix} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
                    rounds.pop(variant, None)
        self.figures["rounds"] = rounds
        self.figures["walls"].update({v: statistics.median(w) for v, w in rounds.items()})  # one round: its wall
        walls = self.figures["walls"]
        for variant, wall in walls.items():
            if "plain" in walls:
                self.bench.record("n", f"RATIO plain/{variant}", walls["plain"] / wall,
                                  "x (whole process; the plain script on one GPU over it)")
            if "plain_defaults" in walls and self.rounds > 1:  # the rounds' medians, and each round's own ratio
                each = ", ".join(f"{a / b:.2f}" for a, b in zip(rounds["plain_defaults"], rounds[variant]))
                self.bench.record("n", f"RATIO plain_defaults/{variant}", walls["plain_defaults"] / wall,
                                  f"x (median of {self.rounds} rounds' whole processes; each round: {each})")
            for split in (s for s in ("split", "split_defaults") if s in walls and variant.startswith("raysweep")):
                each = ", ".join(f"{a / b:.2f}" for a, b in zip(rounds[split], rounds[variant]))
                self.bench.record("n", f"RATIO {split}/{variant}", walls[split] / wall,
                                  f"x (median of {self.rounds} rounds' whole processes; each round: {each})")
        spans = {v: self.figures.get(f"n_{v}", {}).get("shards_span_s") for v in ("raysweep", "raysweep_1")}
        if all(spans.values()):
            self.figures["span_ratio"] = spans["raysweep_1"] / spans["raysweep"]
            self.bench.record("n", "RATIO span raysweep_1/raysweep", self.figures["span_ratio"],
                              f"x (first shard start to last shard end; {self.gpus} GPUs against one)")
        self._save()
        if self.figures.get("failed"):  # after every other variant ran
            raise RuntimeError("; ".join(f"{v}: {why}" for v, why in self.figures["failed"].items()))

    def _note(self, label: str, wall: float) -> float:
        self.bench.record("n", f"{label} wall_s", wall, "s (whole process, start to exit)")
        self.figures.setdefault("notes", {})[label] = wall
        self._save()
        return wall

    def _save(self) -> None:
        (self.out / "n.json").write_text(json.dumps(self.figures, indent=1, default=str))

    def _caches(self, stem: str) -> dict:
        """With --fresh-caches, the environment of empty caches for the run `stem`; else none (the machine's)."""
        return fresh_caches(self.out / "caches" / stem) if self.fresh else {}

    def _model_only(self) -> dict:
        return {"model": self.bench.model_path}

    def _one_gpu(self) -> dict:
        return {"CUDA_VISIBLE_DEVICES": self.devices[0]}

    def _all_gpus(self) -> dict:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices)}

    def _script(self, module: str, prompts: Path, engine_args: dict | None = None) -> list[str]:
        """`engine_args` None: raysweep's own for one whole GPU, with --engine on top."""
        given = vllm_args(self.bench.model_path, self.engine) if engine_args is None else engine_args
        return [sys.executable, "-m", module, "--model", self.bench.model_path, "--prompts", str(prompts),
                "--engine-args", json.dumps(given), "--max-tokens", str(self.max_tokens)]

    def _lm_eval_task(self) -> Path:
        tasks = self.out / "n_tasks"
        tasks.mkdir(exist_ok=True)
        (tasks / "scale_gen.yaml").write_text(textwrap.dedent(f"""\
            task: scale_gen
            dataset_path: json
            dataset_kwargs: {{data_files: {{test: {self.data}}}}}
            test_split: test
            output_type: generate_until
            doc_to_text: "{{{{text}}}}"
            doc_to_target: ""
            generation_kwargs: {{until: [], max_gen_toks: {self.max_tokens}, do_sample: false, temperature: 0}}
            metric_list:
              - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
            """))
        return tasks

    @staticmethod
    def _expect(stem: str, got: int, want: int) -> None:
        if got != want:
            raise RuntimeError(f"{stem}: {got} outputs for {want} prompts")


def _outputs(stdout: str, stem: str) -> int:
    summary = summary_line(stdout)
    if summary is None:
        raise RuntimeError(f"{stem}: no JSON summary line on its stdout")
    return summary["outputs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_out", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of this host to spread over (N)")
    parser.add_argument("--prompts", type=int, default=10496)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}, in order")
    parser.add_argument("--no-warm", action="store_true", help="no untimed warm-up runs (caches already warm)")
    parser.add_argument("--engine", default="{}", help="JSON added to raysweep's engine arguments (both tools')")
    parser.add_argument("--raysweep-engine", default="{}", help="JSON added to raysweep's engine arguments alone")
    parser.add_argument("--tried-engine", action="append", default=[],
                        help="JSON added to raysweep_tried's engine arguments; again: raysweep_tried2's, ...")
    parser.add_argument("--tried-actors", default="{}", help="JSON: the tried variants' `actors:` section (default: "
                                                             "none, the rule's choice)")
    parser.add_argument("--rounds", type=int, default=1, help="the variants run this many times in turn; medians")
    parser.add_argument("--fresh-caches", action="store_true",
                        help="each run on empty compile caches of its own, as on a node new to the model; no warm-ups")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    tried = [json.loads(text) for text in args.tried_engine]
    unknown = sorted(v for v in set(variants) - set(VARIANTS) if not v.startswith("raysweep_tried"))
    if unknown or args.gpus < 1 or args.prompts < args.gpus or args.rounds < 1:
        parser.error(f"variants {unknown} unknown, or --gpus < 1, or fewer prompts than GPUs, or --rounds < 1")
    if {v for v in variants if v.startswith("raysweep_tried")} != {tried_name(k) for k in range(len(tried))} \
            or {} in tried:  # an empty one is `raysweep` again
        parser.error("each --tried-engine JSON (not empty) and its variant (raysweep_tried, raysweep_tried2, ...) "
                     "go together")
    from cluster.inputs.builtin_model import resolve_model_path

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(resolve_model_path(args.model), out, 0)
    bench.record("-", "model", None, args.model)
    try:
        ScaleOut(bench, args.gpus, args.prompts, args.max_tokens, engine=json.loads(args.engine),
                 raysweep_engine=json.loads(args.raysweep_engine), rounds=args.rounds,
                 tried_engines=tried, fresh=args.fresh_caches,
                 tried_actors=json.loads(args.tried_actors)).run(
            variants, warm=not args.no_warm)
    finally:
        bench.save()
    return 0


def tried_name(k: int) -> str:
    """The variant of the k-th (from 0) `--tried-engine`."""
    return "raysweep_tried" if k == 0 else f"raysweep_tried{k + 1}"


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
