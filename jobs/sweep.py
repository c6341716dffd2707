"""`python -m jobs.sweep SPEC` — run a sweep; the entry point for `ray job submit` and `raysweep run`.

This is the edge of the driver process: every expected error (bad spec, bad data, a model that cannot
load, an unusable output, a Ray that does not start) is printed as one line and exits 2; a sweep with
failed shards exits 1. What can be checked cheaply is checked before Ray starts and before the output is
opened, so a bad input leaves both untouched. A spec with `lm_eval:` entries is the exception: lm-eval
builds its tasks (seconds: its import, the documents, the few-shot contexts) while Ray starts, as
`raysweep lm-eval` does; a bad input there stops that Ray again, and no engine has started. The run's steps,
each once, and its teardown in one place: jobs/lifecycle.py (SweepRun).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from cluster.contracts.errors import RaysweepError
from cluster.contracts.shard import ShardState
from cluster.lm_eval.quiet import terminal_stderr  # a stop's line reaches the terminal while lm-eval is quiet
from jobs.ray_output import add_verbose_argument


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="sweep spec (YAML)")
    parser.add_argument("--output", help="output directory or URI (default: the spec's `output`)")
    parser.add_argument("--address", help="Ray cluster address, or `auto` for the one `ray start` runs here "
                                          "(default: RAY_ADDRESS, set by `ray job submit`; else a new local Ray)")
    parser.add_argument("--max-attempts", type=at_least(1), default=3, help="attempts per shard before it is failed")
    parser.add_argument("--dashboard", action="store_true",
                        help="with a new local Ray, start its dashboard too (a cluster's is on its head node); "
                             "off by default: it adds seconds to every sweep's start")
    parser.add_argument("--new-run", action="store_true",
                        help="discard the output's earlier results (also another spec's) and start again")
    add_verbose_argument(parser)


def at_least(minimum: int, most: int | None = None):
    """An argparse type: an integer of at least `minimum` (and at most `most` when given), anything else refused by
    argparse in one line (exit 2) before anything starts (--max-attempts: not after Ray started; --samples: not as
    an OverflowError from deep in the report)."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{value}: must be at most {most}")
        return value

    return integer


def run(args: argparse.Namespace) -> int:
    from cluster.contracts.timing import RunClock
    from jobs import started_at

    clock = RunClock(started_at())  # from Python's start: its imports count, a shell's sleep before it does not
    return run_spec(None, args, clock)


def run_spec(spec, args: argparse.Namespace, clock=None, output_kept: bool = True, verifying: bool = False) -> int:
    """A sweep from its spec to its exit code, through one SweepRun (jobs/lifecycle.py): `spec` loaded already
    (`raysweep verify` builds one), or None to read `args.spec`. `output_kept=False`: the output is removed
    after, so its path is not printed. Ctrl-C or SIGTERM at any moment: one line saying what was committed and
    how to resume (exit 1); `verifying`: verify's own sweep, which nothing resumes."""
    from cluster.contracts.timing import RunClock
    from jobs import started_at
    from jobs.interrupts import Interrupted, interrupted_in, interruptible, stopped_line
    from jobs.lifecycle import SweepRun

    said = threading.Lock()  # the line is said once: by the signal's handler, a GCS or head watch, or here
    life = SweepRun(args, clock or RunClock(started_at()))

    def say_stopped(stop: Interrupted | str) -> None:
        if not said.acquire(blocking=False):
            return
        sink = life.sink  # what is committed at the signal is final: the cleanup commits nothing more
        line = stopped_line(stop, sink, sink.output if sink else None, verifying, output_kept, life.all_committed)
        os.write(terminal_stderr(), (line + "\n").encode())

    try:
        with interruptible(say=say_stopped):  # said at the signal; the cleanup follows (without it if the GCS is gone)
            try:
                with life:
                    life.adopt(spec) if spec is not None else life.read(args.spec)
                    life.check()  # before Ray and before the output is touched: a problem is one line, exit 2
                    life.open(lasting_output(args.output or life.spec.output_path()))
                    life.start_ray()
                    report, node = life.execute(say_stopped)
            except (Interrupted, SystemError) as e:
                # a SystemError raised from the Interrupted: the signal came inside ray.wait's C code (seen under load)
                stop = e if isinstance(e, Interrupted) else interrupted_in(e)
                if stop is None:
                    raise
                say_stopped(stop)  # ray.init's own SIGTERM handler, turned into Interrupted: not said yet
                return 1
    except Interrupted:  # it came as the handlers were put in place: its line was said, nothing had started
        return 1
    return _print_report(report, node, output_kept, args.verbose)


def _shown_path(path: str) -> str:
    """A local path as the user can paste it here: from the current directory where it lies below it (the
    quickstart's results/quickstart), else whole."""
    whole, here = os.path.abspath(path), os.getcwd()
    return os.path.relpath(whole, here) if whole.startswith(here.rstrip(os.sep) + os.sep) else whole


def _print_report(report, node, output_kept: bool = True, verbose: bool = False) -> int:
    print(format_summary(report.summary))
    ran = "nothing run" if report.wall_s is None else \
        f"{report.samples} samples in {report.wall_s:.1f}s once Ray was up"  # None: nothing was left to run
    print(f"\n[raysweep] {ran}, {report.command_s:.1f}s after the command started ({report.shards_run} shards run, "
          f"{report.shards_skipped} already committed)")
    if report.gpu_samples:
        print(f"[raysweep] GPU telemetry: {report.gpu_samples} NVML samples in telemetry/gpu.parquet")
    elif report.shards_run:
        print("[raysweep] GPU telemetry: NVML absent on every actor; GPU columns are null, not zero")
    where = report.output if "://" in report.output else _shown_path(report.output)
    if output_kept:
        print(f"[raysweep] results: {where}" + (f" on node {node}" if node else ""))
    else:
        print("[raysweep] results: not kept: a temporary folder, removed when verify ends (--keep DIR keeps them)")
    unscored = [r for r in report.summary.to_pylist() if r.get("error")]  # its scoring failed (lm-eval tasks)
    for row in unscored:
        print(f"[raysweep] FAILED task {row['model']}/{row['task']}: {row['error']}")
    if report.failed:
        for shard_id, entry in sorted(report.failed.items()):
            print(f"[raysweep] FAILED shard {shard_id}: {entry['errors'][-1]}")
        retried = sum(entry["state"] == ShardState.FAILED for entry in report.failed.values())
        kept = len(report.failed) - retried
        if retried:
            print(f"[raysweep] {retried} shard(s) failed; re-run the same command to retry them")
        if kept:  # committed with error rows past the task's fail_on_error: a re-run keeps them as they are
            print(f"[raysweep] {kept} shard(s) committed with more error rows than their task's fail_on_error "
                  "allows; a re-run keeps them: fix the rows or the setting, then --new-run")
        if not verbose:  # jobs/ray_output.py: the actors' tracebacks and engine logs were not shown
            print("[raysweep] what the actors printed is not shown without --verbose: it is in Ray's logs on each "
                  "actor's node (worker-*.err under /tmp/ray/session_*/logs by default)")
    return 1 if report.failed or unscored else 0


JOB_WORKING_DIRS = "/runtime_resources/working_dir_files/"  # where Ray unpacks a job's --working-dir


def lasting_output(output: str, cwd: str | None = None) -> str:
    """Where a local output goes. Under `ray job submit --working-dir`, the driver runs in a temporary
    copy of that folder which Ray deletes: an output inside that copy (the spec's relative `output:`, or a
    relative --output) goes under RAYSWEEP_RESULTS (default ~/raysweep) on the driver's node instead, at
    its path relative to the working dir, and the run says so."""
    if "://" in output:
        return output
    inside = os.path.realpath(os.path.join(cwd or os.getcwd(), output)).partition(JOB_WORKING_DIRS)[2]
    if not inside:
        return output
    relative = inside.partition("/")[2] or inside  # below the job's package folder (_ray_pkg_<hash>)
    root = os.environ.get("RAYSWEEP_RESULTS") or os.path.join(os.path.expanduser("~"), "raysweep")
    lasting = os.path.join(root, relative)
    print(f"[raysweep] this job runs in Ray's temporary copy of its working dir, deleted after it: the relative "
          f"output {relative} goes to {lasting}", flush=True)
    return lasting


def format_summary(summary) -> str:
    from cluster.report.html_parts import metrics_text

    # samples as the progress line counts them (prompts); a task of several completions per prompt says both
    header = "| model | task | samples | score | ± stderr | structured valid | ok/trunc/skip/err | other metrics |"
    lines = [header, "|---|---|---:|---:|---:|---:|---|---|"]
    for r in summary.to_pylist():
        score = "—" if r["score"] is None else f"{r['score']:.3f}"
        err = "—" if r["stderr"] is None else f"{r['stderr']:.3f}"
        valid = "—" if r["structured_valid_rate"] is None else f"{100 * r['structured_valid_rate']:.1f}%"
        samples = r.get("n_samples")
        count = r["n"] if samples is None or samples == r["n"] else f"{samples} ({r['n']} completions)"
        lines.append(f"| {r['model']} | {r['task']} | {count} | {score} | {err} | {valid} | "
                     f"{r['n_ok']}/{r['n_truncated']}/{r['n_skipped']}/{r['n_error']} | {metrics_text(r['metrics'])} |")
    return "\n".join(lines)


def guarded(fn, args: argparse.Namespace) -> int:
    """The process's edge: a RaysweepError (cluster/contracts/errors.py) as one line naming what is wrong,
    exit with its code; anything else with its traceback."""
    try:
        return fn(args)
    except RaysweepError as e:
        print(f"raysweep: error: {e}", file=sys.stderr)
        return e.exit_code


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
