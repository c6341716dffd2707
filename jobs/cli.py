"""The `raysweep` command: `raysweep run SPEC` runs a sweep, `raysweep plan SPEC` prints its plan,
`raysweep report OUTPUT` writes one self-contained HTML report of a sweep's output."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from jobs.sweep import add_run_arguments, exit_now, guarded, run


def plan(args: argparse.Namespace) -> int:
    from cluster.run import preflight
    from cluster.spec import load_spec

    rows = []
    for mp in preflight(load_spec(args.spec), strict=False):
        for tp in mp.tasks:
            lengths = tp.lengths
            rows.append({
                "model": mp.model.name, "task": tp.task.name, "samples": int(len(lengths)), "shards": len(tp.shards),
                "tokens_p50": int(np.percentile(lengths, 50)), "tokens_p95": int(np.percentile(lengths, 95)),
                "tokens_max": int(lengths.max()), "threshold": tp.threshold,
                "short_shards": sum(s.profile == "short" for s in tp.shards),
                "long_shards": sum(s.profile == "long" for s in tp.shards),
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
    from jobs.report import write_report  # matplotlib loads only for this command

    print(write_report(args.output, args.out))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raysweep")
    except PackageNotFoundError:  # run from a checkout that is not installed (PYTHONPATH)
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raysweep", description="Ray-distributed LLM evaluation sweeps.")
    parser.add_argument("--version", action="version", version=f"raysweep {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="run a sweep"))
    plan_parser = sub.add_parser("plan", help="print the shard plan of a sweep (no GPUs claimed)")
    plan_parser.add_argument("spec", help="sweep spec (YAML)")
    plan_parser.add_argument("--json", action="store_true", help="machine-readable output")
    report_parser = sub.add_parser("report", help="write one self-contained HTML report of a sweep's output")
    report_parser.add_argument("output", help="the sweep's output directory")
    report_parser.add_argument("-o", "--out", help="where to write the HTML (default: OUTPUT/report.html)")
    args = parser.parse_args(argv)
    return guarded({"run": run, "plan": plan, "report": report}[args.command], args)


def entry() -> None:
    """The installed `raysweep` command."""
    exit_now(main())


if __name__ == "__main__":
    entry()
