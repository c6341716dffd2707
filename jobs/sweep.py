"""`python -m jobs.sweep SPEC` — run a sweep; the entry point for `ray job submit` and `raysweep run`.

This is the edge of the driver process: every expected error (bad spec, bad data, a model that cannot
load, an unusable output) is printed as one line and exits 2; a sweep with failed shards exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys

EXPECTED_ERRORS = ("SpecError", "DataError", "PreflightError", "PreflightFailure", "SinkError", "ActorStartError",
                   "ReportError", "PlacementError")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="sweep spec (YAML)")
    parser.add_argument("--output", help="output directory or URI (default: the spec's `output`)")
    parser.add_argument("--address", help="Ray cluster address, or `auto` for the one `ray start` runs here "
                                          "(default: RAY_ADDRESS, set by `ray job submit`; else a new local Ray)")
    parser.add_argument("--max-attempts", type=int, default=3, help="attempts per shard before it is failed")
    parser.add_argument("--dashboard", action="store_true",
                        help="with a new local Ray, start its dashboard too (a cluster's is on its head node); "
                             "off by default: it adds seconds to every sweep's start")
    parser.add_argument("--new-run", action="store_true",
                        help="discard the output's earlier results (also another spec's) and start again")


def run(args: argparse.Namespace) -> int:
    from cluster.timing import RunClock

    clock = RunClock()  # from this process's start: Python and imports count, as on a user's stopwatch
    import ray

    from cluster.run import execute, prepare
    from cluster.spec import load_spec

    # the spec and the output are checked here; data, models and structured specs on the planner's
    # thread while Ray starts; actors start with Ray, engines only for models that passed (cluster/preflight.py)
    spec = load_spec(args.spec)
    prepared = prepare(spec, output=lasting_output(args.output or spec.output), new_run=args.new_run, background=True)
    try:
        # without --address or RAY_ADDRESS, start a new local Ray rather than ray.init()'s default of
        # joining whatever /tmp/ray records as this machine's cluster, which may be long dead
        address = args.address or os.environ.get("RAY_ADDRESS") or "local"
        print("[raysweep] starting a local Ray" if address == "local" else f"[raysweep] connecting to Ray at {address}",
              flush=True)
        # a dashboard can only be chosen for a Ray this process starts
        dashboard = {"include_dashboard": args.dashboard} if address == "local" else {}
        ray.init(address=address, log_to_driver=True, **dashboard)
    except BaseException:
        prepared.sink.close()
        raise
    clock.mark("ray_start")
    print(f"[raysweep] Ray is up ({clock.record()['ray_start_s']:.1f}s after the command started); actors starting",
          flush=True)
    try:
        report = execute(prepared, max_attempts=args.max_attempts, clock=clock)
        # a local output on a cluster of several nodes is on the driver's node only: say which
        node = ray.util.get_node_ip_address() if "://" not in report.output and len(ray.nodes()) > 1 else None
    finally:
        ray.shutdown()
    print(format_summary(report.summary))
    print(f"\n[raysweep] {report.samples} samples in {report.wall_s:.1f}s "
          f"({report.shards_run} shards run, {report.shards_skipped} already committed)")
    if report.gpu_samples:
        print(f"[raysweep] GPU telemetry: {report.gpu_samples} NVML samples in telemetry/gpu.parquet")
    elif report.shards_run:
        print("[raysweep] GPU telemetry: NVML absent on every actor; GPU columns are null, not zero")
    where = report.output if "://" in report.output else os.path.abspath(report.output)  # a local path, whole
    print(f"[raysweep] results: {where}" + (f" on node {node}" if node else ""))
    if report.failed:
        for shard_id, entry in sorted(report.failed.items()):
            print(f"[raysweep] FAILED shard {shard_id}: {entry['errors'][-1]}")
        print(f"[raysweep] {len(report.failed)} shard(s) failed; re-run the same command to retry them")
        return 1
    return 0


JOB_WORKING_DIRS = "/runtime_resources/working_dir_files/"  # where Ray unpacks a job's --working-dir


def lasting_output(output: str, cwd: str | None = None) -> str:
    """Where a relative local output goes. Under `ray job submit --working-dir`, the driver runs in a
    temporary copy of that folder which Ray deletes: a relative output there goes under RAYSWEEP_RESULTS
    (default ~/raysweep) on the driver's node instead, and the run says so."""
    cwd = cwd or os.getcwd()
    if "://" in output or os.path.isabs(output) or JOB_WORKING_DIRS not in os.path.realpath(cwd) + "/":
        return output
    root = os.environ.get("RAYSWEEP_RESULTS") or os.path.join(os.path.expanduser("~"), "raysweep")
    lasting = os.path.join(root, output)
    print(f"[raysweep] this job runs in Ray's temporary copy of its working dir, deleted after it: the relative "
          f"output {output} goes to {lasting}", flush=True)
    return lasting


def format_summary(summary) -> str:
    header = "| model | task | n | score | ± stderr | structured valid | ok/trunc/skip/err |"
    lines = [header, "|---|---|---:|---:|---:|---:|---|"]
    for r in summary.to_pylist():
        score = "—" if r["score"] is None else f"{r['score']:.3f}"
        err = "—" if r["stderr"] is None else f"{r['stderr']:.3f}"
        valid = "—" if r["structured_valid_rate"] is None else f"{100 * r['structured_valid_rate']:.1f}%"
        lines.append(f"| {r['model']} | {r['task']} | {r['n']} | {score} | {err} | {valid} | "
                     f"{r['n_ok']}/{r['n_truncated']}/{r['n_skipped']}/{r['n_error']} |")
    return "\n".join(lines)


def guarded(fn, args: argparse.Namespace) -> int:
    """Expected errors as one line naming what is wrong (exit 2); anything else with its traceback."""
    try:
        return fn(args)
    except Exception as e:
        if type(e).__name__ in EXPECTED_ERRORS:
            print(f"raysweep: error: {e}", file=sys.stderr)
            return 2
        raise


def exit_now(code: int) -> None:
    """End a command-line process once its output is out: flushed, then `os._exit`. The sweep has closed
    its files and Ray by then; what Python would still do at exit (join threads, run finalizers, free
    every module) took 1.7 s of a 28 s quickstart on a 2-core machine, time a user waits for nothing."""
    import atexit
    import logging

    atexit._run_exitfuncs()  # what was registered to run at exit still runs (finalizers: staging folders)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.sweep", description="Run a raysweep sweep.")
    add_run_arguments(parser)
    return guarded(run, parser.parse_args(argv))


if __name__ == "__main__":
    exit_now(main())
