"""`python -m jobs.sweep SPEC` — run a sweep; the entry point for `ray job submit` and `raysweep run`.

This is the edge of the driver process: every expected error (bad spec, bad data, a model that cannot
load, an unusable output, a Ray that does not start) is printed as one line and exits 2; a sweep with
failed shards exits 1. What can be checked cheaply is checked before Ray starts and before the output is
opened, so a bad input leaves both untouched. A spec with `lm_eval:` entries is the exception: lm-eval
builds its tasks (seconds: its import, the documents, the few-shot contexts) while Ray starts, as
`raysweep lm-eval` does; a bad input there stops that Ray again, and no engine has started.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from cluster.contracts.errors import RaysweepError
from cluster.contracts.shard import ShardState
from jobs.ray_output import add_verbose_argument
from jobs.ray_start import check_ray_address, start_ray


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


def at_least(minimum: int):
    """An argparse type: an integer of at least `minimum`, anything else refused by argparse in one line (exit 2)
    before anything starts (--max-attempts: not after Ray started)."""
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        return value

    return integer


def run(args: argparse.Namespace) -> int:
    from cluster.contracts.timing import RunClock
    from jobs import started_at

    clock = RunClock(started_at())  # from Python's start: its imports count, a shell's sleep before it does not
    from cluster.inputs.spec_file import load_spec

    # 1. Before Ray and before the output is touched, the cheap checks: the spec, every data file (one
    #    pass), structured specs, where each model is, the Ray address. A problem is one line, exit 2.
    #    lm-eval's tasks take seconds to build: Ray starts meanwhile (and stops again on a bad input).
    #    The engines' imports start at once too, in a local run's engine host (engine_host).
    raw = _quick_look(args.spec)
    host = engine_host(raw, _ray_address(args)[0]) if raw else None
    early = _ray_starting(args) if raw and _names_lm_eval_tasks(raw) else None
    try:
        spec = load_spec(args.spec)
    except BaseException:
        _stop(early)
        if host is not None:
            host.stop()
        raise
    return run_spec(spec, args, clock, ray_starting=early, host=host)


def _quick_look(path: str) -> dict | None:
    """The spec file as YAML, or None where it is not readable YAML of a mapping (load_spec then says what is
    wrong, before anything starts)."""
    import yaml

    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
    except Exception:  # noqa: BLE001
        return None
    return raw if isinstance(raw, dict) else None


def _backends(raw: dict) -> list[str]:
    """The engine backends the spec's models name (`engine: NAME` or `engine: {backend: NAME}`), `auto` for
    the rest and for what load_spec will refuse."""
    from cluster.contracts.spec import BACKENDS

    found = []
    for model in raw.get("models") if isinstance(raw.get("models"), list) else []:
        engine = model.get("engine") if isinstance(model, dict) else None
        backend = engine if isinstance(engine, str) else engine.get("backend") if isinstance(engine, dict) else None
        found.append(backend if backend in BACKENDS else "auto")
    return found or ["auto"]


def _names_lm_eval_tasks(raw: dict) -> bool:
    """Whether the spec has a `lm_eval:` entry among its tasks (a quick look: load_spec checks it all)."""
    tasks = raw.get("tasks")
    return isinstance(tasks, list) and any(isinstance(t, dict) and "lm_eval" in t for t in tasks)


def engine_host(spec, address: str):
    """A new local Ray's engine host (cluster/launch.py), started now: the engines' imports run while the
    spec and inputs are checked and Ray starts. `spec`: a SweepSpec, or the spec file's YAML (a quick look,
    before load_spec checks it). None for a Ray cluster (its actors are on other machines) and for a
    reproducible run (its actors set vLLM's batch-invariant mode for their own process); RAYSWEEP_ENGINE_HOST=0
    turns it off."""
    if isinstance(spec, dict):
        reproducible, backends = spec.get("reproducible") is True, _backends(spec)
    else:
        reproducible, backends = spec.reproducible, [m.backend for m in spec.models]
    if address != "local" or reproducible:
        return None
    from cluster.launch import start_engine_host

    return start_engine_host(backends)


def _ray_address(args: argparse.Namespace) -> tuple[str, str]:
    """Where Ray is, and what named it. Without --address or RAY_ADDRESS a new local Ray, rather than
    ray.init()'s default of joining whatever /tmp/ray records as this machine's cluster, which may be long dead."""
    address = args.address or os.environ.get("RAY_ADDRESS") or "local"
    return address, "--address" if args.address else "RAY_ADDRESS"


def _ray_starting(args: argparse.Namespace):
    """Ray's start (or connection) on a thread of its own (jobs/background.py), from now on."""
    from jobs.background import Background

    address, named = _ray_address(args)

    def start() -> None:
        check_ray_address(address, named)
        start_ray(address, named, args.dashboard, args.verbose)

    return Background(start, "raysweep-ray-start")


def _stop(starting) -> None:
    """A Ray started early, stopped again: an input was bad (or the run was stopped) before the sweep began."""
    if starting is None:
        return
    from jobs import local_ray

    try:
        starting.result()
    except BaseException:  # noqa: BLE001  (the input's error is the one said)
        pass
    local_ray.shutdown()


def run_spec(spec, args: argparse.Namespace, clock=None, output_kept: bool = True, ray_starting=None, host=None) -> int:
    """`run` for a spec already loaded (`raysweep verify` builds one): the checks, Ray, the sweep, the summary
    (`output_kept=False`: the output is removed after, so its path is not printed). Ctrl-C or SIGTERM at any
    moment: one line saying what was committed and how to resume (exit 1)."""
    from jobs.interrupts import Interrupted, interrupted_in, interruptible, stopped_line

    said = threading.Lock()  # the line is said once: by the signal's handler, a GCS or head watch, or here

    def say_stopped(stop: Interrupted | str) -> None:
        if not said.acquire(blocking=False):
            return
        sink = held.get("sink")  # what is committed at the signal is final: the cleanup commits nothing more
        os.write(2, (stopped_line(stop, sink, sink.output if sink else None) + "\n").encode())

    held: dict = {"say": say_stopped}  # the line's teller, and what the run has opened so far: the output's sink

    with interruptible(say=say_stopped):  # said at the signal; the cleanup follows (without it if the GCS is gone)
        try:
            report, node = _run_spec(spec, args, clock, held, ray_starting, host)
        except (Interrupted, SystemError) as e:
            # a SystemError raised from the Interrupted: the signal came inside ray.wait's C code (seen under load)
            stop = e if isinstance(e, Interrupted) else interrupted_in(e)
            if stop is None:
                raise
            say_stopped(stop)  # ray.init's own SIGTERM handler, turned into Interrupted: not said yet
            return 1
    return _print_report(report, node, output_kept, args.verbose)


def _run_spec(spec, args: argparse.Namespace, clock, held: dict, ray_starting=None, host=None):
    from cluster.contracts.timing import RunClock
    from jobs import started_at

    clock = clock or RunClock(started_at())
    address, named = _ray_address(args)
    if host is not None and spec.reproducible:  # the quick look missed it: the actors run their engines
        host.stop()
        host = None
    elif host is None:
        host = engine_host(spec, address)
    try:
        return _run_spec_with(spec, args, clock, held, ray_starting, host)
    finally:
        if host is not None:
            host.stop()


def _run_spec_with(spec, args: argparse.Namespace, clock, held: dict, ray_starting, host):
    import ray

    from cluster.inputs.checks import check_inputs
    from cluster.schedule.run import execute, prepare
    from jobs import local_ray
    from jobs.head_watch import head_watched
    from jobs.interrupts import Interrupted, reclaim

    address, named = _ray_address(args)
    try:
        data = check_inputs(spec)
        print(f"[raysweep] inputs checked: {len(data)} task(s), {sum(d.n_rows for d in data)} rows, "
              f"{len(spec.models)} model(s) ({time.time() - clock.started_at:.1f}s after the command started)",
              flush=True)
        if ray_starting is None:
            check_ray_address(address, named)
        # 2. The output opened; Ray started; then the expensive part (models, tokenizers, tokens, shards) on the
        #    planner's thread from the checked data while the actors start (PlanSource.start, in execute); engines
        #    start only for models that passed (cluster/inputs/checks.py)
        prepared = prepare(spec, lasting_output(args.output or spec.output_path()), args.new_run, background=True,
                           data=data)
    except BaseException:
        _stop(ray_starting)
        raise
    held["sink"] = prepared.sink
    try:
        if ray_starting is not None:
            ray_starting.result()
        else:
            start_ray(address, named, args.dashboard, args.verbose)
        reclaim()  # Ray's core worker took SIGTERM over: ours again, so it ends the run in one line
    except BaseException as e:
        prepared.sink.close()
        local_ray.shutdown()  # a local Ray half started (a signal during its start) leaves no process behind
        if isinstance(e, SystemExit) and e.code == signal.SIGTERM:  # ray.init's own handler: sys.exit(15), no word
            raise Interrupted(signal.SIGTERM) from None
        raise
    clock.mark("ray_start")
    print(f"[raysweep] Ray is up ({clock.record()['ray_start_s']:.1f}s after the command started); actors starting",
          flush=True)
    try:
        with head_watched(held["say"]):  # its GCS or raylet lost: the line, exit 1, in about a second
            report = execute(prepared, max_attempts=args.max_attempts, clock=clock,
                             engine_host=host.address if host is not None else None)
            # a local output on a cluster of several nodes is on the driver's node only: say which
            node = ray.util.get_node_ip_address() if "://" not in report.output and len(ray.nodes()) > 1 else None
    finally:
        local_ray.shutdown()
    return report, node


def _print_report(report, node, output_kept: bool = True, verbose: bool = False) -> int:
    print(format_summary(report.summary))
    print(f"\n[raysweep] {report.samples} samples in {report.wall_s:.1f}s "
          f"({report.shards_run} shards run, {report.shards_skipped} already committed)")
    if report.gpu_samples:
        print(f"[raysweep] GPU telemetry: {report.gpu_samples} NVML samples in telemetry/gpu.parquet")
    elif report.shards_run:
        print("[raysweep] GPU telemetry: NVML absent on every actor; GPU columns are null, not zero")
    where = report.output if "://" in report.output else os.path.abspath(report.output)  # a local path, whole
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
