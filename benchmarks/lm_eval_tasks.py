"""Bench part (t): lm-eval tasks through raysweep and through `lm_eval --model vllm`, whole processes, one GPU.

    python -m benchmarks.lm_eval_tasks --out DIR [--model builtin:small] [--docs 1200] [--phase all|warm|timed]

1. Tasks: two local lm-eval task YAMLs over seeded synthetic data (`dataset_path: json`), `docs` documents
   each: `bench_mc` (multiple choice, four choices, 2-shot contexts from a train split) and `bench_gen`
   (generate_until, `until: ["\\n\\n", "Q:"]`, 64 tokens at most, GSM8K's regex filter, exact_match).
2. The two commands, each a new process timed from just before its start to just after its exit:
   - raysweep: `python -m jobs.cli run SPEC` with the spec a user writes: one `lm_eval:` entry naming both
     tasks, `num_fewshot: 2`, no `actors:` section;
   - lm-eval: `python -m lm_eval --model vllm --model_args pretrained=PATH,max_model_len=N --tasks
     bench_mc,bench_gen --include_path ... --num_fewshot 2 --batch_size auto --log_samples`;
   both with the same model and max_model_len (vLLM's defaults otherwise); `--two-engines` times raysweep
   again with `actors: {count: 2, num_gpus: 0.5}`. `--phase warm` runs each once
   with `limit: 32` (vLLM's compile cache and the page cache warm), `timed` the full runs, `all` both.
3. Agreement, from the two runs' lm-eval sample files: per document, the same acc (mc) and the same
   response (gen); aggregated metrics side by side (bf16 may move near-ties: counted, not hidden).
Prints `[bench] t ...` lines and writes `t.json` in `out`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import sys
import textwrap
from pathlib import Path

from benchmarks.loglik import LETTERS, timed

MAX_MODEL_LEN = 2048
WARM_LIMIT = 32


def write_tasks(out: Path, docs: int) -> Path:
    rng = random.Random(0)
    data = out / "t_data"
    data.mkdir(parents=True, exist_ok=True)

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi))).strip() or "x"

    for name, n in (("mc_test", docs), ("mc_train", 32)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({
            "question": text(200, 400), "choices": [text(3, 12) for _ in range(4)], "label": rng.randrange(4)}) + "\n"
            for _ in range(n)))
    (data / "gen_test.jsonl").write_text("".join(json.dumps({
        "question": text(100, 300), "answer": f"#### {rng.randrange(1000)}"}) + "\n" for _ in range(docs)))
    tasks = out / "t_tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "bench_mc.yaml").write_text(textwrap.dedent(f"""\
        task: bench_mc
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {data}/mc_test.jsonl, train: {data}/mc_train.jsonl}}}}
        test_split: test
        fewshot_split: train
        output_type: multiple_choice
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: label
        metric_list:
          - {{metric: acc, aggregation: mean, higher_is_better: true}}
          - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
        """))
    (tasks / "bench_gen.yaml").write_text(textwrap.dedent(f"""\
        task: bench_gen
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {data}/gen_test.jsonl}}}}
        test_split: test
        output_type: generate_until
        doc_to_text: "Q: {{{{question}}}}\\nA:"
        doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
        generation_kwargs: {{until: ["\\n\\n", "Q:"], max_gen_toks: 64, do_sample: false}}
        filter_list:
          - name: strict-match
            filter:
              - {{function: regex, regex_pattern: "#### (\\\\-?[0-9]+)"}}
              - {{function: take_first}}
        metric_list:
          - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
        """))
    return tasks


def spec_file(out: Path, name: str, model_path: str, tasks: Path, limit: int | None, actors: dict | None = None) -> Path:
    entry = {"tasks": ["bench_mc", "bench_gen"], "include_path": str(tasks), "num_fewshot": 2}
    if limit:
        entry["limit"] = limit
    path = out / f"{name}.yaml"
    path.write_text(json.dumps({"name": name, "output": str(out / f"{name}_out"),
                                "models": [{"name": "m", "path": model_path, "engine": {"max_model_len": MAX_MODEL_LEN}}],
                                "tasks": [{"lm_eval": entry}], **({"actors": actors} if actors else {})}))
    return path


def lm_eval_argv(model_path: str, tasks: Path, dest: Path, limit: int | None) -> list[str]:
    return [sys.executable, "-m", "lm_eval", "--model", "vllm", "--model_args",
            f"pretrained={model_path},max_model_len={MAX_MODEL_LEN}", "--tasks", "bench_mc,bench_gen",
            "--include_path", str(tasks), "--num_fewshot", "2", "--batch_size", "auto", "--output_path", str(dest),
            "--log_samples", *(["--limit", str(limit)] if limit else [])]


def samples(folder: Path, task: str) -> dict[tuple, dict]:
    path = glob.glob(f"{folder}/**/samples_{task}_*.jsonl", recursive=True)[0]
    return {(r["filter"], r["doc_id"]): r for r in map(json.loads, open(path))}


def agreement(ours: Path, theirs: Path) -> dict:
    figures = {}
    for task, key in (("bench_mc", "acc"), ("bench_gen", "resps")):
        a, b = samples(ours, task), samples(theirs, task)
        same = sum(a[k][key] == b[k][key] for k in a if k in b)
        figures[task] = {"documents": len(a), "in_both": len(set(a) & set(b)), f"same_{key}": same}
    results = [json.loads(Path(glob.glob(f"{d}/**/results_*.json", recursive=True)[0]).read_text())["results"]
               for d in (ours, theirs)]
    figures["metrics"] = {task: {k: [results[0][task].get(k), v] for k, v in results[1][task].items() if k != "alias"}
                          for task in ("bench_mc", "bench_gen")}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_eval_tasks", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--docs", type=int, default=1200)
    parser.add_argument("--phase", choices=("all", "warm", "timed"), default="all")
    parser.add_argument("--two-engines", action="store_true",
                        help="also time the spec with two engines on the GPU (actors: count 2, num_gpus 0.5)")
    parser.add_argument("--cli", action="store_true",
                        help="also time lm-eval's own command line with raysweep as its model (`raysweep lm-eval "
                             "--model raysweep`, its default model_args: one engine)")
    args = parser.parse_args(argv)
    from cluster.inputs.builtin_model import resolve_model_path

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(args.model)
    tasks = write_tasks(out, args.docs)
    if args.phase in ("all", "warm"):
        _fresh(out, "t-warm_out")
        warm = spec_file(out, "t-warm", model_path, tasks, WARM_LIMIT)
        print(f"[bench] t warm raysweep {timed([sys.executable, '-m', 'jobs.cli', 'run', str(warm)], out / 't_warm_rs'):.1f} s",
              flush=True)
        print(f"[bench] t warm lm-eval {timed(lm_eval_argv(model_path, tasks, out / 't_warm_lm', WARM_LIMIT), out / 't_warm_lm'):.1f} s",
              flush=True)
    if args.phase == "warm":
        return 0
    _fresh(out, "t-sweep_out", "t-two_out", "t_cli_runs")  # a phase run again measures work, not a resume
    spec = spec_file(out, "t-sweep", model_path, tasks, None)
    lm_s = timed(lm_eval_argv(model_path, tasks, out / "t_lm", None), out / "t_lm")
    print(f"[bench] t lm_eval --model vllm: {lm_s:.1f} s", flush=True)
    rs_s = timed([sys.executable, "-m", "jobs.cli", "run", str(spec)], out / "t_rs")
    print(f"[bench] t raysweep run: {rs_s:.1f} s", flush=True)
    two_s = None
    if args.two_engines:
        two = spec_file(out, "t-two", model_path, tasks, None, actors={"count": 2, "num_gpus": 0.5})
        two_s = timed([sys.executable, "-m", "jobs.cli", "run", str(two)], out / "t_two")
        print(f"[bench] t raysweep run, two engines on the GPU: {two_s:.1f} s", flush=True)
    cli_s = cli_agreement = None
    if args.cli:
        argv = lm_eval_argv(model_path, tasks, out / "t_cli", None)
        argv[1:5] = ["-m", "jobs.cli", "lm-eval", "--model", "raysweep"]  # lm_eval's own arguments after them
        argv[argv.index("--model_args") + 1] += f",output={out / 't_cli_runs'}"
        cli_s = timed(argv, out / "t_cli")
        cli_agreement = agreement(out / "t_cli", out / "t_lm")
        print(f"[bench] t raysweep lm-eval --model raysweep: {cli_s:.1f} s; RATIO lm-eval/it = {lm_s / cli_s:.3f} x; "
              f"agreement: {json.dumps(cli_agreement)}", flush=True)
    figures = {"model": args.model, "documents_per_task": args.docs, "max_model_len": MAX_MODEL_LEN,
               "raysweep_two_engines_s": two_s, "raysweep_lm_eval_cli_s": cli_s, "cli_agreement": cli_agreement,
               "lm_eval_vllm_s": lm_s, "raysweep_s": rs_s, "ratio_lm_eval_over_raysweep": lm_s / rs_s,
               "raysweep_run_line": next((line for line in (out / "t_rs.stdout").read_text().splitlines()
                                          if "samples in" in line and "shards run" in line), None),
               "agreement": agreement(out / "t-sweep_out" / "lm_eval", out / "t_lm")}
    print(f"[bench] t whole process: raysweep {rs_s:.1f} s, lm_eval --model vllm {lm_s:.1f} s "
          f"({args.docs} documents x 2 tasks, {args.model}); RATIO lm-eval/raysweep = {lm_s / rs_s:.3f} x")
    print(f"[bench] t agreement: {json.dumps(figures['agreement'])}")
    (out / "t.json").write_text(json.dumps(figures, indent=2))
    return 0


def _fresh(out: Path, *names: str) -> None:
    """Earlier runs' raysweep outputs removed, before any clock starts: a second timed phase in the same folder
    resumed them (every shard committed) and timed 17.3 s of nothing."""
    for name in names:
        shutil.rmtree(out / name, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
