"""The `raysweep` command: `raysweep run SPEC` runs a sweep, `raysweep plan SPEC` prints its plan,
`raysweep report OUTPUT` writes one self-contained HTML report of a sweep's output, `raysweep models`
lists the builtin models, `raysweep spec-reference` prints the spec reference (sweeps/REFERENCE.md),
`raysweep pool up|status|down` keeps engines warm between sweeps (jobs/pool.py), `raysweep verify OUTPUT`
generates a sample of a sweep's rows again and says how many match (jobs/verify.py). The commands that start or
join a Ray (run, verify, pool) show Ray's and Serve's own log lines only with `--verbose` (jobs/ray_output.py)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from jobs.pool import add_pool_arguments, pool
from jobs.sweep import add_run_arguments, at_least, exit_now, guarded, run
from jobs.verify import add_verify_arguments, verify


def plan(args: argparse.Namespace) -> int:
    from cluster.contracts.shard import LONG, SHORT
    from cluster.inputs.checks import check_inputs
    from cluster.inputs.spec_file import load_spec
    from cluster.plan.plan_source import preflight
    from jobs.plan_ticker import PlanTicker
    from jobs.silence import watched

    with watched(lambda line: print(line, file=sys.stderr, flush=True), "the spec read (lm-eval's tasks, if it names "
                 "some, indexed and loaded, and their requests built)"):
        spec = load_spec(args.spec)
    data = check_inputs(spec).data
    with PlanTicker(spec) as ticker:  # stdout holds the table (or the JSON) alone: the ticker's lines go to stderr
        plans = preflight(spec, strict=False, data=data, planned=ticker.planned)
    rows = []
    for mp in plans:
        for tp in mp.tasks:
            lengths = tp.lengths
            measured = tp.task.replay is None  # a replay task's prompts are measured by no tokenizer
            rows.append({
                "model": mp.model.name, "task": tp.task.name, "samples": int(len(lengths)), "shards": len(tp.shards),
                "tokens_p50": int(np.percentile(lengths, 50)) if measured else None,
                "tokens_p95": int(np.percentile(lengths, 95)) if measured else None,
                "tokens_max": int(lengths.max()) if measured else None, "threshold": tp.threshold,
                "short_shards": sum(s.profile == SHORT for s in tp.shards),
                "long_shards": sum(s.profile == LONG for s in tp.shards),
                "truncated": tp.n_truncated, "skipped": tp.n_skipped, "refused": tp.n_refused, "empty": tp.n_empty, "limit": tp.limit,
            })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = list(rows[0]) if rows else []
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("—" if r[c] is None else str(r[c]) for c in cols) + " |")
    return 0


def report(args: argparse.Namespace) -> int:
    from cluster.report.page import write_report  # matplotlib loads only for this command

    left_out: list[str] = []  # files not committed, or not what was committed: each said above, and exit 1
    print(write_report(args.output, args.out, samples=args.samples, warned=left_out))
    return 1 if left_out else 0


def models(args: argparse.Namespace) -> int:
    from cluster.contracts.model_paths import BUILTIN_PREFIX
    from cluster.inputs.builtin_model import CONFIGS, VERSION, cache_root

    print(f"{'model':<16}{'parameters':>11}{'layers':>7}{'hidden':>7}{'heads':>6}{'vocab':>6}{'max len':>8}"
          f"{'weights':>17}  cached")
    for name, cfg in CONFIGS.items():
        n, vocab = builtin_parameters(cfg)
        dtype = np.dtype(cfg.get("storage", "float32"))
        size = n * dtype.itemsize / 2**20
        size_text = f"{size:.0f} MiB" if size < 1024 else f"{size / 1024:.1f} GiB"
        built = cache_root() / f"builtin-{name}-{VERSION}"
        print(f"{BUILTIN_PREFIX + name:<16}{n / 1e6 if n < 1e9 else n / 1e9:>10.1f}{'M' if n < 1e9 else 'B'}"
              f"{cfg['num_hidden_layers']:>7}{cfg['hidden_size']:>7}{cfg['num_attention_heads']:>6}{vocab:>6}"
              f"{cfg['max_position_embeddings']:>8}{size_text + ' ' + dtype.name:>17}  "
              f"{built if (built / 'model.safetensors').exists() else 'no: built on first use'}")
    return 0


def builtin_parameters(cfg: dict) -> tuple[int, int]:
    """Parameters and vocabulary of a builtin model, from its shape (the tensors of
    cluster/inputs/builtin_model.py's _write_weights: tied embeddings, Llama attention with grouped KV, SwiGLU MLP,
    RMSNorm weights); tests compare it with a built model's safetensors."""
    from cluster.inputs.builtin_model import SPECIAL_TOKENS

    vocab, h, inter = 256 + len(SPECIAL_TOKENS), cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    layer = 2 * h * h + 2 * kv * h + 3 * inter * h + 2 * h
    return vocab * h + cfg["num_hidden_layers"] * layer + h, vocab


def spec_reference(args: argparse.Namespace) -> int:
    from jobs.spec_reference import render

    print(render(), end="")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raysweep")
    except PackageNotFoundError:  # run from a checkout that is not installed (PYTHONPATH)
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # lm-eval's own command line follows, as lm-eval parses it (jobs/lm_eval_command.py)
        from jobs.lm_eval_command import run as lm_eval

        return guarded(lambda rest: lm_eval(rest), argv[1:])
    parser = argparse.ArgumentParser(prog="raysweep", description="Ray-distributed LLM evaluation sweeps.")
    parser.add_argument("--version", action="version", version=f"raysweep {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="run a sweep"))
    plan_parser = sub.add_parser("plan", help="print the shard plan of a sweep (no GPUs claimed)")
    plan_parser.add_argument("spec", help="sweep spec (YAML)")
    plan_parser.add_argument("--json", action="store_true", help="machine-readable output")
    report_parser = sub.add_parser("report", help="write one self-contained HTML report of sweep outputs, side by side")
    report_parser.add_argument("output", nargs="+", help="the sweep's output directory; several are compared")
    report_parser.add_argument("-o", "--out", help="where to write the HTML (default: the first OUTPUT/report.html)")
    report_parser.add_argument("--samples", type=at_least(0, most=1_000_000), default=200, metavar="N",
                               help="rows per task in the sample browser, disagreements first "
                                    "(default 200; at most 1000000)")
    sub.add_parser("models", help="list the builtin models (path: builtin:NAME) with their sizes")
    sub.add_parser("spec-reference", help="print the sweep spec reference (Markdown; sweeps/REFERENCE.md)")
    add_pool_arguments(sub.add_parser("pool", help="engines kept warm between sweeps (Ray Serve): up, status, down"))
    add_verify_arguments(sub.add_parser("verify", help="generate a sample of a sweep's rows again: do they match?"))
    sub.add_parser("lm-eval", help="lm-eval's command line with raysweep as its model: raysweep lm-eval --model "
                                   "raysweep --model_args pretrained=builtin:tiny --tasks ... (docs/lm-eval.md)")
    args = parser.parse_args(argv)
    commands = {"run": run, "plan": plan, "report": report, "models": models, "spec-reference": spec_reference,
                "pool": pool, "verify": verify}
    return guarded(commands[args.command], args)


def entry() -> None:
    """The installed `raysweep` command."""
    exit_now(main())


if __name__ == "__main__":
    entry()
