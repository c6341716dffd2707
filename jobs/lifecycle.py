"""A command's sweeps from its start to its exit (`SweepRun`): the one sweep of `raysweep run`, `ray job submit`
(both `python -m jobs.sweep`) and `raysweep verify`'s second run; under `raysweep lm-eval` (and lm-eval's own
`simple_evaluate(model="raysweep")`), one sweep per request type lm-eval asks for, on the same Ray and engines
(jobs/lm_eval_model.py).

What is the process's happens once, however many sweeps it runs:
- `begin`: the engine host decided once, from what a quick look at a spec file or lm-eval's model_args tell (a new
  local Ray's, started at once so the engines' imports run while the rest is checked; none on a Ray cluster or for
  a reproducible run), else by the first spec; Ray's start begun at once where lm-eval builds tasks or requests
  (seconds) first;
- Ray started or joined once (the first sweep's step 4; a later sweep's finds it up);
- with `keep_engines`, the actors of one sweep kept for the next (cluster/schedule/fleet.py KeptActors);
- `temporary_folder`: a folder removed at the end (named by this process: one a killed command left is removed by
  the next command that makes one);
- `close` (also on any error or signal): the teardown, in one place: the open sweep's output sink where the sweep
  did not close it, the temporary folders, the kept actors, this process's Ray, the engine host.
Each sweep goes through the same steps, each once, in this order:
1. `read` (a spec file) or `adopt` (a spec already loaded): the spec read once;
2. `check`: every input checked once (cluster/inputs/checks.py), before the output is touched;
3. `open`: the output opened, the plan ready to stream (cluster/schedule/run.py `prepare`);
4. `start_ray`: Ray started or joined (once, by the first sweep: a later one's finds it up);
5. `execute`: the sweep, watched for a lost head.
A bad input before the first sweep's step 4 leaves its output untouched and stops a Ray started early; no engine
has started.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable


def _printed(line: str) -> None:
    print(line, flush=True)


@dataclass
class _Sweep:
    """One sweep's own state, from its spec to its end."""
    spec: object  # its SweepSpec
    data: list | None = None  # its inputs, as `check` read them
    prepared: object = None  # its output opened (cluster/schedule/run.py Prepared)
    executed: bool = False  # it ran: it closed its output's sink itself

    def close(self) -> None:
        if self.prepared is not None and not self.executed:
            self.prepared.sink.close()


class SweepRun:
    def __init__(self, args: argparse.Namespace, clock, log: Callable[[str], None] = _printed,
                 keep_engines: bool = False, address_option: str = "--address"):
        """`args`: the command's address, dashboard, verbose, new_run and max_attempts. `clock`: the command's
        (cluster/contracts/timing.py RunClock). `log`: where this run's lines and its sweeps' go. `keep_engines`:
        one sweep's actors kept for the next. `address_option`: what the messages call an address given."""
        self.args, self.clock, self.log = args, clock, log
        self.address = args.address or os.environ.get("RAY_ADDRESS") or "local"
        self.named = address_option if args.address else "RAY_ADDRESS"
        self.host = self.kept = None
        self.sweep: _Sweep | None = None  # the sweep under way, or the last one
        self._keep_engines = keep_engines
        self._ray_starting = None  # Ray's start on a thread of its own (jobs/background.py), where begun early
        self._ray_started = False
        self._host_decided = False
        self._folders: list[str] = []  # temporary_folder's, removed at close

    # -- the process's: the engine host, Ray's early start, temporary folders ------------------------------------
    def begin(self, backends: list[str], reproducible: bool = False, ray_early: bool = False) -> None:
        """The engine host decided, once (a later call keeps the first's decision); with `ray_early`, Ray's start
        begun on a thread of its own, once (lm-eval builds its tasks or requests while it starts)."""
        if not self._host_decided:
            self._host_decided = True
            if self.address == "local" and not reproducible:  # RAYSWEEP_ENGINE_HOST=0: none (cluster/launch.py)
                from cluster.launch import start_engine_host

                self.host = start_engine_host(backends)
        if ray_early and self._ray_starting is None and not self._ray_started:
            from jobs.background import Background

            self._ray_starting = Background(self._start_ray, "raysweep-ray-start")

    def temporary_folder(self, purpose: str) -> str:
        """A new folder, removed at close: `raysweep-PURPOSE-PID-*` in the temporary folder; those of the same
        purpose whose command no longer runs (killed before its close) are removed now."""
        import tempfile

        from cluster.launch import remove_stale_folders

        prefix = f"raysweep-{purpose}-"
        folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        self._folders.append(folder)
        remove_stale_folders(os.path.dirname(folder), prefix)
        return folder

    # -- 1. the spec ---------------------------------------------------------------------------------------
    def read(self, path: str):
        """The spec file, loaded once. Before that, a quick look at its YAML begins the process's part: the
        engine host and, for a spec with `lm_eval:` entries, Ray (lm-eval builds its tasks while they start)."""
        from cluster.inputs.spec_file import load_spec

        from jobs.silence import watched

        raw = quick_look(path)
        lm_eval = raw is not None and names_lm_eval_tasks(raw)
        if raw is not None:
            self.begin(backends_named(raw), raw.get("reproducible") is True, lm_eval)
        with watched(self.log, "lm-eval indexes and loads its tasks and builds their requests" if lm_eval else
                     "the spec read"):
            spec = load_spec(path)
        return self.adopt(spec)

    def adopt(self, spec):
        """A spec already loaded (`verify` builds one; lm-eval's model makes one per request type): a new sweep.
        Its engine host decided here where `begin` did not, or stopped where the spec turned out reproducible (its
        actors run their own engines)."""
        if self.sweep is not None:
            self.sweep.close()
        self.sweep = _Sweep(spec)
        if self.host is not None and spec.reproducible:
            self.host.stop()
            self.host = None
        else:
            self.begin([m.backend for m in spec.models], spec.reproducible)
        return spec

    @property
    def spec(self):
        return self.sweep.spec if self.sweep is not None else None

    # -- 2, 3. the inputs and the output ---------------------------------------------------------------------
    def check(self) -> None:
        from cluster.inputs.checks import check_inputs
        from jobs.ray_start import check_ray_address

        spec = self.sweep.spec
        self.sweep.data = check_inputs(spec)
        self.log(f"[raysweep] inputs checked: {len(self.sweep.data)} task(s), "
                 f"{sum(d.n_rows for d in self.sweep.data)} rows, {len(spec.models)} model(s) "
                 f"({time.time() - self.clock.started_at:.1f}s after the command started)")
        if self._ray_starting is None and not self._ray_started:
            check_ray_address(self.address, self.named)

    def open(self, output: str) -> None:
        """The output opened and the plan made ready: the expensive part (models, tokenizers, tokens, shards) runs
        on the planner's thread from the checked data while the actors start (cluster/schedule/run.py)."""
        from cluster.schedule.run import prepare

        self.sweep.prepared = prepare(self.sweep.spec, self.sweep.data, output, self.args.new_run, background=True)

    @property
    def sink(self):
        return self.sweep.prepared.sink if self.sweep is not None and self.sweep.prepared is not None else None

    # -- 4, 5. Ray and the sweep -------------------------------------------------------------------------------
    @property
    def ray_begun(self) -> bool:
        """Whether this process's Ray was started or joined, or its start begun."""
        return self._ray_starting is not None or self._ray_started

    def _start_ray(self) -> None:
        from jobs.ray_start import check_ray_address, start_ray

        check_ray_address(self.address, self.named)
        start_ray(self.address, self.named, self.args.dashboard, self.args.verbose)
        self.clock.mark("ray_start")  # when it came up, also where it started early (on a thread of its own)

    def start_ray(self) -> None:
        """Ray started or joined (or its early start waited for), by the first sweep; a later sweep finds it up."""
        from jobs.interrupts import Interrupted, reclaim

        if self._ray_started:
            return
        self._ray_started = True
        try:
            if self._ray_starting is not None:
                self._ray_starting.result()
            else:
                self._start_ray()
            reclaim()  # Ray's core worker took SIGTERM over: ours again, so it ends the run in one line
        except SystemExit as e:  # ray.init's own SIGTERM handler: sys.exit(15), no word
            if e.code == signal.SIGTERM:
                raise Interrupted(signal.SIGTERM) from None
            raise
        self.clock.mark("ray_start", once=True)
        self.log(f"[raysweep] Ray is up ({self.clock.record()['ray_start_s']:.1f}s after the command started); "
                 "actors starting")

    def execute(self, say_stopped):
        """The sweep on the started Ray, its head watched (lost: `say_stopped`'s line, exit 1, in about a
        second): the report, and the driver's node where a local output sits on one node of several."""
        import ray

        from cluster.schedule.run import execute
        from jobs.head_watch import head_watched

        if self._keep_engines and self.kept is None:
            from cluster.schedule.fleet import KeptActors

            self.kept = KeptActors()
        self.sweep.executed = True
        with head_watched(say_stopped):
            report = execute(self.sweep.prepared, log=self.log, max_attempts=self.args.max_attempts,
                             clock=self._sweep_clock(), kept=self.kept,
                             engine_host=self.host.address if self.host is not None else None)
            node = ray.util.get_node_ip_address() if "://" not in report.output and len(ray.nodes()) > 1 else None
        return report, node

    def _sweep_clock(self):
        """This sweep's clock: the command's start and Ray's, its own results and planning (a later sweep's are
        not the first's)."""
        import copy

        clock = copy.copy(self.clock)
        clock.marks = {name: at for name, at in self.clock.marks.items() if name == "ray_start"}
        return clock

    # -- the end -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """What this process opened, closed, once: 1. the sweep's sink where the sweep did not close it (a failure
        before it ran); 2. the temporary folders; 3. this process's Ray (a start still under way waited for first:
        a half-started local Ray leaves nothing), the actors kept on it closed before it stops; 4. the engine host."""
        import shutil

        from jobs import local_ray

        try:
            if self.sweep is not None:
                self.sweep.close()
            while self._folders:
                shutil.rmtree(self._folders.pop(), ignore_errors=True)
            if self._ray_starting is not None:
                try:
                    self._ray_starting.result()
                except BaseException:  # noqa: BLE001  (the run's own error is the one said)
                    pass
            if self.ray_begun:
                self._ray_starting, self._ray_started = None, False
                try:
                    import ray

                    if self.kept is not None and ray.is_initialized():  # else Ray's own exit stopped them with it
                        self.kept.close()
                finally:
                    local_ray.shutdown()
        finally:
            if self.host is not None:
                self.host.stop()
                self.host = None

    def __enter__(self) -> "SweepRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quick_look(path: str) -> dict | None:
    """The spec file as YAML, or None where it is not readable YAML of a mapping (load_spec then says what is
    wrong, before anything starts)."""
    import yaml

    if not os.path.isfile(path):  # a named pipe would block open(); load_spec names what it is instead
        return None
    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
    except Exception:  # noqa: BLE001
        return None
    return raw if isinstance(raw, dict) else None


def backends_named(raw: dict) -> list[str]:
    """The engine backends the spec's models name (`engine: NAME` or `engine: {backend: NAME}`), `auto` for
    the rest and for what load_spec will refuse."""
    from cluster.contracts.spec import BACKENDS

    found = []
    for model in raw.get("models") if isinstance(raw.get("models"), list) else []:
        engine = model.get("engine") if isinstance(model, dict) else None
        backend = engine if isinstance(engine, str) else engine.get("backend") if isinstance(engine, dict) else None
        found.append(backend if backend in BACKENDS else "auto")
    return found or ["auto"]


def names_lm_eval_tasks(raw: dict) -> bool:
    """Whether the spec has a `lm_eval:` entry among its tasks (a quick look: load_spec checks it all)."""
    tasks = raw.get("tasks")
    return isinstance(tasks, list) and any(isinstance(t, dict) and "lm_eval" in t for t in tasks)
