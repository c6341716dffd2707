"""Bench part (l): log-likelihood multiple choice on a GPU, raysweep against a plain vLLM script, whole processes.

    python -m benchmarks.loglik --out DIR [--model builtin:small] [--rows 8000] [--cpu-rows 32]

1. Data: `rows` multiple-choice rows of synthetic text (contexts of 200-600 bytes, four choices of 3-12
   bytes with a leading space, a label), written as {"context", "choices", "label"} JSONL, seeded.
2. Each of the two runs once untimed over 64 rows (vLLM's compile cache and the page cache warm), then
   once timed, each a new process, timed from just before its start to just after its exit:
   `python -m jobs.sweep SPEC --new-run` (a `type: loglikelihood` task, one actor on the whole GPU) and
   `python -m benchmarks.plain_vllm_loglik MODEL DATA` (one `LLM(...)`, one `generate` with prompt_logprobs).
3. Agreement: raysweep's per-choice log-probabilities against the plain script's (both vLLM, bf16), and
   against the CPU engine's (transformers, fp32, `cpu-rows` rows, in this process): the largest and mean
   absolute difference per token, and how often the argmax choice is the same.
Prints `[bench] l ...` lines and writes `l.json` in `out`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.common import REPO

WARM_ROWS = 64
LETTERS = "abcdefghijklmnopqrstuvwxyz      "


def write_rows(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            context = "".join(rng.choice(LETTERS) for _ in range(rng.randint(200, 600))).strip() + "\nAnswer:"
            choices = [" " + "".join(rng.choice(LETTERS[:26]) for _ in range(rng.randint(3, 12))) for _ in range(4)]
            f.write(json.dumps({"context": context, "choices": choices, "label": rng.randrange(4)}) + "\n")
    return path


def spec_text(name: str, model: str, data: Path, output: Path) -> str:
    return json.dumps({"name": name, "output": str(output), "models": [{"name": "m", "path": model}],
                       "tasks": [{"name": "mc", "type": "loglikelihood", "data": str(data), "prompt": "{context}",
                                  "choices": "choices", "target": "label"}],
                       "shards": {"max_samples": 512}, "actors": {"count": 1, "num_gpus": 1}})


def timed(argv: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log.with_suffix(".stdout"), "w") as out, open(log.with_suffix(".stderr"), "w") as err:
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=err, env=os.environ | {"PYTHONUNBUFFERED": "1"}).returncode
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {code}; see {log}.stderr")
    return wall


def raysweep_logprobs(output: Path) -> dict[int, list[float]]:
    table = pq.read_table(output / "results", columns=["sample_id", "choice_logprobs", "status"])
    return {int(s): lp for s, lp, st in zip(*(table[c].to_pylist() for c in table.column_names)) if st == "ok"}


def compare(a: dict[int, list[float]], b: dict[int, list[float]], tokens: dict[int, list[int]]) -> dict:
    """Per-token absolute differences of each choice's sum, and argmax agreement, over the rows both have."""
    rows = sorted(set(a) & set(b))
    per_token = [abs(x - y) / n for r in rows for x, y, n in zip(a[r], b[r], tokens[r])]
    same = sum(max(range(len(a[r])), key=a[r].__getitem__) == max(range(len(b[r])), key=b[r].__getitem__)
               for r in rows)
    return {"rows": len(rows), "max_abs_per_token": max(per_token), "mean_abs_per_token": statistics.fmean(per_token),
            "argmax_same": same}


def cpu_engine_logprobs(model_path: str, data: Path, n: int) -> tuple[dict[int, list[float]], dict[int, list[int]]]:
    """The CPU engine (transformers, fp32) over the first `n` rows, tokenized as raysweep's actors do."""
    from transformers import AutoTokenizer

    from actors.engine import EngineProfile, LoglikRequest
    from actors.hf_engine import HFEngine
    from cluster.contracts.loglikelihood import encode_pairs
    from cluster.contracts.spec import ModelSpec

    rows = [json.loads(line) for line in open(data)]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    encoded = encode_pairs([r["context"] for r in rows], [r["choices"] for r in rows], tokenizer, True)
    tokens = {i: [len(c) for c in conts] for i, (_, conts) in enumerate(encoded)}
    engine = HFEngine(ModelSpec("m", model_path), model_path, EngineProfile(), num_threads=os.cpu_count())
    got = engine.loglikelihood([LoglikRequest(str(i), ctx, conts) for i, (ctx, conts) in enumerate(encoded[:n])])
    return {int(r.sample_id): r.logprobs for r in got}, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loglik", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--cpu-rows", type=int, default=32)
    parser.add_argument("--no-warm", action="store_true", help="skip the untimed runs (caches warm already)")
    args = parser.parse_args(argv)
    from cluster.inputs.builtin_model import resolve_model_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(args.model)
    data, warm = write_rows(out / "l_rows.jsonl", args.rows), write_rows(out / "l_warm.jsonl", WARM_ROWS, seed=1)
    for name, rows in (("l_warm", warm), ("l_sweep", data)):
        (out / f"{name}.yaml").write_text(spec_text(name.replace("_", "-"), model_path, rows, out / f"{name}_out"))

    def sweep(name: str) -> list[str]:
        return [sys.executable, "-m", "jobs.sweep", str(out / f"{name}.yaml"), "--new-run"]

    def plain(rows: Path, dest: Path) -> list[str]:
        return [sys.executable, "-m", "benchmarks.plain_vllm_loglik", model_path, str(rows), "--out", str(dest)]

    if not args.no_warm:
        timed(sweep("l_warm"), out / "l_warm_sweep")
        timed(plain(warm, out / "l_warm_plain.jsonl"), out / "l_warm_plain")
    plain_s = timed(plain(data, out / "l_plain.jsonl"), out / "l_plain")
    sweep_s = timed(sweep("l_sweep"), out / "l_sweep")
    figures = {"model": args.model, "rows": args.rows, "choices": 4 * args.rows, "plain_s": plain_s,
               "raysweep_s": sweep_s, "ratio_plain_over_raysweep": plain_s / sweep_s,
               "plain_stdout": (out / "l_plain.stdout").read_text().strip().splitlines()[-1]}
    print(f"[bench] l whole process: raysweep {sweep_s:.1f} s, plain vLLM prompt_logprobs script {plain_s:.1f} s "
          f"({args.rows} rows x 4 choices, {args.model})")
    print(f"[bench] l RATIO plain/raysweep = {plain_s / sweep_s:.3f} x")
    ours = raysweep_logprobs(out / "l_sweep_out")
    theirs = {r["row"]: r["logprobs"] for r in map(json.loads, open(out / "l_plain.jsonl"))}
    cpu, tokens = cpu_engine_logprobs(model_path, data, args.cpu_rows)
    figures["raysweep_vs_plain"] = compare(ours, theirs, tokens)
    figures["raysweep_vllm_vs_cpu_engine"] = compare(ours, cpu, tokens)
    for key in ("raysweep_vs_plain", "raysweep_vllm_vs_cpu_engine"):
        print(f"[bench] l {key}: {json.dumps(figures[key])}")
    (out / "l.json").write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
