"""Bench part (s): lm-eval's standard suite at the size teams evaluate, raysweep against `lm_eval --model vllm`.

    python -m benchmarks.suite_8b --out DIR --fraction 0.05 [--gpus 4] [--shape large]
        [--variants lm_eval_1,raysweep_1,lm_eval_n,raysweep_n] [--checkpoints 4 --ckpt-fraction F [--ckpt-lm-eval 4]]
        [--tasks choice] [--raysweep-engine JSON] [--fresh-caches] [--peer-env JSON] [--raysweep-env JSON]

1. The model and data (benchmarks/suite_tasks.py): a random-weight Llama of `--shape` (`large`: Llama-3-8B's
   shape) with a 32,000-token BPE vocabulary, and lm-eval 0.4.13's own task definitions for `mmlu`, `hellaswag`,
   `arc_challenge`, `winogrande` and `gsm8k`, fed local synthetic documents of the real datasets' fields and
   lengths, `--fraction` of each real split's count. Each task's few-shot count (SHOTS: the leaderboard's) is
   written into its copied definition, so one command of either tool runs the whole suite.
2. Whole processes, each timed from just before its start to just after its exit, in this order:
   - `raysweep_1`: `python -m jobs.cli run SPEC` with one `lm_eval:` entry naming the suite's tasks and the
     include path, no `actors:` section, on GPU 0;
   - `lm_eval_1`: `lm_eval --model vllm --model_args pretrained=M,max_model_len=N --tasks ... --batch_size auto
     --log_samples` on GPU 0;
   - `raysweep_n`, `lm_eval_n`: the same on `--gpus` GPUs (lm-eval with `data_parallel_size=N`);
   - with `--checkpoints K`: `K` models of the same shape (other seeds) over the suite at `--ckpt-fraction`:
     `raysweep_ckpt` (one spec naming the K models, every GPU) against `lm_eval_ckpt` (lm-eval with
     `data_parallel_size=N`, once per checkpoint, one after another, as its users run it; `--ckpt-lm-eval`
     names the checkpoints it runs where not all, or `none`, and then no ratio is given).
   The variants share the machine's compile caches: on a fresh machine the first to run compiles, and a later one
   with the same engine arguments finds them compiled. `--fresh-caches` gives every variant empty caches of its
   own instead (vLLM's, Inductor's, Triton's, FlashInfer's: `fresh_caches`), as on a node new to the model.
   `--tasks` runs some of the suite's tasks (`choice`: the log-likelihood ones alone), each variant's name then
   ending in `_TASKS`. `--raysweep-engine JSON` is added to raysweep's engine arguments (a setting tried against
   lm-eval's own, e.g. the uncompiled start of actors/vllm_args.py UNCOMPILED). `--peer-env JSON` is added to
   lm-eval's environment alone: lm-eval given a setting raysweep's engines have (actors/vllm_args.py ENGINE_ENV);
   `--raysweep-env JSON` to raysweep's alone (e.g. `{"RAYSWEEP_WEIGHT_SWAP": "0"}`: a new engine for every
   checkpoint, actors/weight_swap.py).
3. Agreement of each pair, once both its runs are done (`raysweep_1` and `lm_eval_1`: `agreement`; `raysweep_n`
   and `lm_eval_n`: `agreement_n`; checkpoint K's records of `raysweep_ckpt` and lm-eval's run of it:
   `agreement_ckpt_K`; and `nearest_ckpt_K`: per document of checkpoint K's records, the run its values lie
   closest to among lm-eval's runs and raysweep's records of the other checkpoints), from the lm-eval sample
   files, per task: the documents whose `acc` / `acc_norm` decision differs, with each one's margin (the gap
   between the two choices in lm-eval's own values); each choice's log-likelihood difference; the aggregates and
   stderr side by side; gsm8k's responses equal. And from raysweep's telemetry, the prompt tokens requested and
   computed, and each engine start (its actor, model, reason, profile, seconds) with the shards of each model
   that ran on it.
Prints `[bench] s ...` lines and writes OUT/s.json after each step (a call cut short keeps what was done).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks.common import engine_lives, engine_starts, fresh_caches, run_process
from benchmarks.suite_agreement import CHOICE_TASKS, agreement, nearest_runs

SHOTS = {"mmlu": 5, "hellaswag": 10, "arc_challenge": 25, "winogrande": 5, "gsm8k": 5}
MAX_MODEL_LEN = 4096
VARIANTS = ("raysweep_1", "lm_eval_1", "raysweep_n", "lm_eval_n")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_shots(tasks: Path, shots: dict[str, int]) -> None:
    """Each task definition's few-shot count: `num_fewshot` in the copied YAML that names the task (mmlu's in
    the template every subject includes), replaced where the YAML has one and added where it has not."""
    for path in tasks.rglob("*yaml"):
        text = path.read_text()
        name = re.search(r"^task:\s*(\S+)", text, re.M)
        key = "mmlu" if path.name == "_default_template_yaml" else (name.group(1) if name else None)
        if key not in shots or (key == "mmlu" and path.name != "_default_template_yaml"):
            continue
        line = f"num_fewshot: {shots[key]}"
        text = re.sub(r"^num_fewshot:.*$", line, text, flags=re.M) if re.search(r"^num_fewshot:", text, re.M) \
            else text.rstrip("\n") + f"\n{line}\n"
        path.write_text(text)


def prepare(out: Path, fraction: float, seeds: list[int], shape: str) -> tuple[Path, list[Path]]:
    from benchmarks.suite_tasks import write_suite, write_tokenizer
    from benchmarks.weight_files import has_weights

    tasks = write_suite(out / f"tasks-{fraction}", fraction)
    set_shots(tasks, SHOTS)
    tokenizer = out / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        write_tokenizer(tokenizer)
    models = [out / f"model-{shape}-{seed}" for seed in seeds]
    missing = [(path, seed) for path, seed in zip(models, seeds) if not has_weights(path)]
    with ProcessPoolExecutor(max_workers=max(1, len(missing))) as pool:  # numpy draws one core per model
        list(pool.map(_build_model, [(path, seed, shape, tokenizer) for path, seed in missing]))
    return tasks, models


def _build_model(job: tuple) -> None:
    from benchmarks.suite_tasks import write_model

    path, seed, shape, tokenizer = job
    write_model(path, seed, shape=shape, tokenizer_from=tokenizer)


def lm_eval_argv(peer: str, model: Path, tasks: Path, dest: Path, gpus: int, names=tuple(SHOTS)) -> list[str]:
    args = f"pretrained={model},max_model_len={MAX_MODEL_LEN}" if peer == "vllm" else f"pretrained={model}"
    if gpus > 1:
        args += f",data_parallel_size={gpus}"
    return [sys.executable, "-m", "lm_eval", "--model", peer, "--model_args", args, "--tasks", ",".join(names),
            "--include_path", str(tasks), "--batch_size", "auto" if peer == "vllm" else "8", "--output_path",
            str(dest), "--log_samples"]


def spec_file(out: Path, name: str, models: list[Path], tasks: Path, names=tuple(SHOTS), engine=None) -> Path:
    path = out / f"{name}.yaml"
    path.write_text(json.dumps({
        "name": name, "output": str(out / f"{name}_out"),
        "models": [{"name": m.name, "path": str(m), "engine": {"max_model_len": MAX_MODEL_LEN, **(engine or {})}}
                   for m in models],
        "tasks": [{"lm_eval": {"tasks": list(names), "include_path": str(tasks)}}]}))
    return path


def gpu_env(gpus: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus))), **MULTICAST_OFF}


def token_counts(output: Path) -> dict:
    """raysweep's log-likelihood prompt tokens, requested and computed, summed over its shards' telemetry."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(output / "telemetry" / "shards.parquet")
    table = table.filter(pc.is_null(table["error"]))
    requested, computed = (pc.sum(table[c]).as_py() for c in ("prompt_tokens_requested", "prompt_tokens_computed"))
    return {"requested": requested, "computed": computed,
            "computed_share": computed / requested if requested else None}


# -- the run -------------------------------------------------------------------------------------
class Suite:
    def __init__(self, out: Path, peer: str, names=tuple(SHOTS), engine: dict | None = None, fresh: bool = False,
                 peer_env: dict[str, str] | None = None, own_env: dict[str, str] | None = None):
        self.out, self.peer, self.figures, self.names, self.engine = out, peer, {}, tuple(names), engine or {}
        self.fresh, self.peer_env, self.own_env = fresh, dict(peer_env or {}), dict(own_env or {})

    def env(self, name: str, gpus: int) -> dict[str, str]:
        """A variant's environment: its GPUs, and with `fresh` compile caches of its own, empty when it starts
        (a checkpoint loop's processes share their variant's, as one tool run on one node would)."""
        return {**gpu_env(gpus), **(fresh_caches(self.out / "caches" / name) if self.fresh else {})}

    def save(self) -> None:
        (self.out / "s.json").write_text(json.dumps(self.figures, indent=2, default=str))

    def lm_eval(self, name: str, models: list[Path], tasks: Path, gpus: int, only: list[int] | None = None) -> float:
        """lm-eval once per model (of `only`'s numbers from 1, where given), one after another."""
        total, env = 0.0, {**self.env(name, gpus), **self.peer_env}
        for k, model in enumerate(models):
            if only is not None and k + 1 not in only:
                continue
            dest = self.out / (f"{name}_{k}" if len(models) > 1 else name)
            wall, _ = run_process(lm_eval_argv(self.peer, model, tasks, dest, gpus, self.names), env,
                                  self.out / dest.name)
            total += wall
        self._say(name, total, f"lm_eval --model {self.peer}, {len(models)} model(s), {gpus} GPU(s)")
        return total

    def raysweep(self, name: str, models: list[Path], tasks: Path, gpus: int) -> float:
        spec = spec_file(self.out, name, models, tasks, self.names, self.engine)
        wall, stdout = run_process([sys.executable, "-m", "jobs.cli", "run", str(spec)],
                                   {**self.env(name, gpus), **self.own_env}, self.out / name)
        line = next((x for x in stdout.splitlines() if "samples in" in x and "shards run" in x), None)
        self.figures[f"{name}_line"] = line
        self.figures[f"{name}_tokens"] = token_counts(self.out / f"{name}_out")
        self.figures[f"{name}_engines"] = engine_starts(self.out / f"{name}_out")
        starts = {k: [round(v, 1) for v in vs] for k, vs in self.figures[f"{name}_engines"].items()}
        self._say(name, wall, f"raysweep run, {len(models)} model(s), {gpus} GPU(s); {line}; "
                              f"log-likelihood tokens {json.dumps(self.figures[f'{name}_tokens'])}; "
                              f"engine starts (s) {json.dumps(starts)}")
        self.figures[f"{name}_lives"] = lives = engine_lives(self.out / f"{name}_out")
        for life in lives:  # which engine ran which model's shards
            print(f"[bench] s {name} engine {life}", flush=True)
        self.save()
        return wall

    def ratio(self, name: str, theirs: str, ours: str) -> None:
        if theirs in self.figures and ours in self.figures:
            self.figures[name] = self.figures[theirs] / self.figures[ours]
            print(f"[bench] s RATIO {name} = {self.figures[name]:.2f} x", flush=True)
            self.save()

    def _say(self, name: str, wall: float, what: str) -> None:
        self.figures[name] = wall
        print(f"[bench] s {name}: {wall:.1f} s ({what})", flush=True)
        self.save()


def _print_lengths(out: Path, folders: list[Path]) -> None:
    from benchmarks.suite_tasks import prompt_lengths

    for folder in dict.fromkeys(folders):
        for task, (docs, mean, longest) in prompt_lengths(folder, out / "tokenizer").items():
            print(f"[bench] s {folder.parent.name} {task}: {docs} documents, few-shot context of the first 20 "
                  f"(each subject's for mmlu): mean {mean:.0f} tokens, max {longest}", flush=True)


def _run_variant(suite: Suite, variant: str, suffix: str, model: Path, tasks: Path, gpus: int) -> None:
    """One variant's whole process; after the second of a pair (raysweep_N and lm_eval_N), their agreement."""
    (suite.lm_eval if variant.startswith("lm_eval") else suite.raysweep)(variant + suffix, [model], tasks, gpus)
    n = variant.rsplit("_", 1)[1]
    ours, theirs = f"raysweep_{n}{suffix}", f"lm_eval_{n}{suffix}"
    if {ours, theirs} <= set(suite.figures):
        _compare(suite, "agreement" if n == "1" else "agreement_n", f"{ours}_out/lm_eval", theirs)


def _compare(suite: Suite, key: str, ours: str, theirs: str) -> None:
    """The agreement of raysweep's lm-eval records under OUT/`ours` with lm-eval's run under OUT/`theirs`, kept
    as `key` and printed (the documents whose decision differs, with their margins, in s.json)."""
    suite.figures[key] = agreement(suite.out / ours, suite.out / theirs)
    brief = {t: {k: v for k, v in f.items() if k != "differing"} for t, f in suite.figures[key].items()
             if t != "metrics"}
    print(f"[bench] s {key} {ours} vs {theirs}: {json.dumps(brief)}", flush=True)
    print(f"[bench] s {key} metrics [raysweep, lm-eval]: {json.dumps(suite.figures[key]['metrics'])}", flush=True)
    suite.save()


def _run_checkpoints(suite: Suite, models: list[Path], tasks: Path, gpus: int, suffix: str, peers: list[int]) -> None:
    """raysweep's one sweep of the checkpoints, then lm-eval once for each of `peers` (numbers from 1); each of
    those checkpoints' records against lm-eval's run of it; and for every checkpoint, the run nearest each of its
    documents among lm-eval's and raysweep's records of the other checkpoints."""
    suite.raysweep(f"raysweep_ckpt{suffix}", models, tasks, gpus)
    if peers:
        suite.lm_eval(f"lm_eval_ckpt{suffix}", models, tasks, gpus, only=peers)
    ours = [suite.out / f"raysweep_ckpt{suffix}_out" / "lm_eval" / checkpoint.name for checkpoint in models]
    theirs = {k: suite.out / f"lm_eval_ckpt{suffix}_{k - 1}" for k in peers}
    for k in peers:
        _compare(suite, f"agreement_ckpt{suffix}_{k}", ours[k - 1].relative_to(suite.out).as_posix(), theirs[k].name)
    for k in range(1, len(models) + 1):
        key = f"nearest_ckpt{suffix}_{k}"
        suite.figures[key] = nearest = nearest_runs(ours[k - 1], [*theirs.values(), *ours[:k - 1], *ours[k:]])
        print(f"[bench] s {key} (the run nearest each document, of lm-eval's and raysweep's other checkpoints'): "
              f"{json.dumps(nearest)}", flush=True)
        suite.save()
    if len(peers) == len(models):
        suite.ratio(f"lm_eval_ckpt{suffix}/raysweep_ckpt{suffix}", f"lm_eval_ckpt{suffix}", f"raysweep_ckpt{suffix}")


def _numbers(parser: argparse.ArgumentParser, given: str | None, count: int) -> list[int]:
    """`--ckpt-lm-eval`: the checkpoints lm-eval runs, numbers from 1 (all where not given, none for `none`)."""
    if given in (None, "none"):
        return list(range(1, count + 1)) if given is None else []
    try:
        numbers = sorted({int(k) for k in given.split(",")})
    except ValueError:
        numbers = []
    if not numbers or not set(numbers) <= set(range(1, count + 1)):
        parser.error(f"--ckpt-lm-eval: checkpoint numbers 1 to {count}, comma separated; got {given!r}")
    return numbers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite_8b", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--fraction", type=float, default=0.05, help="of each real split's document count")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--shape", default="large", help="builtin_model CONFIGS key: large = Llama-3-8B's shape")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--checkpoints", type=int, default=0, help="also K checkpoints x the suite (0: not run)")
    parser.add_argument("--ckpt-fraction", type=float, default=None, help="the checkpoint sweep's fraction")
    parser.add_argument("--ckpt-lm-eval", default=None,
                        help="the checkpoints lm-eval runs, e.g. 4, or none (default: all; the ratio needs all)")
    parser.add_argument("--peer", default="vllm", help="lm-eval's model: vllm (GPU), hf (a CPU dry run)")
    parser.add_argument("--tasks", default=",".join(SHOTS),
                        help="some of the suite's tasks (`choice`: the log-likelihood ones); the variants' names then "
                             "end in _TASKS")
    parser.add_argument("--raysweep-engine", default="{}", help="JSON added to raysweep's engine arguments")
    parser.add_argument("--fresh-caches", action="store_true",
                        help="each variant starts with empty compile caches of its own, as on a node new to the model")
    parser.add_argument("--peer-env", default="{}",
                        help="JSON of environment variables for lm-eval's processes alone, e.g. a vLLM setting "
                             "raysweep sets in its own engines: '{\"VLLM_USE_FLASHINFER_SAMPLER\": \"0\"}'")
    parser.add_argument("--raysweep-env", default="{}",
                        help="JSON of environment variables for raysweep's processes alone, e.g. "
                             "'{\"RAYSWEEP_WEIGHT_SWAP\": \"0\"}'")
    parser.add_argument("--build-only", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    names = CHOICE_TASKS if args.tasks == "choice" else tuple(args.tasks.split(","))
    if not names or not set(names) <= set(SHOTS):
        parser.error(f"--tasks: some of {', '.join(SHOTS)}, or `choice`; got {args.tasks!r}")
    if args.variants and not set(args.variants.split(",")) <= set(VARIANTS):
        parser.error(f"--variants: some of {', '.join(VARIANTS)}; got {args.variants!r}")
    peers = _numbers(parser, args.ckpt_lm_eval, args.checkpoints)
    suffix = "" if set(names) == set(SHOTS) else "_" + ("choice" if set(names) == set(CHOICE_TASKS) else "-".join(names))
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **MULTICAST_OFF})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = Suite(out, args.peer, names, json.loads(args.raysweep_engine), args.fresh_caches, json.loads(args.peer_env),
                  json.loads(args.raysweep_env))
    if args.checkpoints:  # every checkpoint built at once, before any clock starts
        ckpt_tasks, models = prepare(out, args.ckpt_fraction or args.fraction, list(range(1, args.checkpoints + 1)),
                                     args.shape)
    tasks, (model,) = prepare(out, args.fraction, [1], args.shape)
    suite.figures.update({"fraction": args.fraction, "shape": args.shape, "gpus": args.gpus, "shots": SHOTS,
                          "peer_env": suite.peer_env, "raysweep_env": suite.own_env})
    if args.build_only:  # lm-eval loads every task's documents here: the datasets cache is warm for both tools
        _print_lengths(out, [tasks, *([ckpt_tasks] if args.checkpoints else [])])
        return 0
    for variant in args.variants.split(",") if args.variants else []:
        _run_variant(suite, variant, suffix, model, tasks, 1 if variant.endswith("_1") else args.gpus)
    for n in ("1", "n"):
        suite.ratio(f"lm_eval_{n}{suffix}/raysweep_{n}{suffix}", f"lm_eval_{n}{suffix}", f"raysweep_{n}{suffix}")
    if args.checkpoints:
        _run_checkpoints(suite, models, ckpt_tasks, args.gpus, suffix, peers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
