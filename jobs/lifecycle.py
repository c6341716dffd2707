"""A command's sweeps from its start to its exit (`SweepRun`): the one sweep of `raysweep run`, `ray job submit`
(both `python -m jobs.sweep`) and `raysweep verify`'s second run; under `raysweep lm-eval` (and lm-eval's own
`simple_evaluate(model="raysweep")`), one sweep per request type lm-eval asks for, on the same Ray and engines
(jobs/lm_eval_model.py).

What is the process's happens once, however many sweeps it runs:
- `begin`: the engine host decided once, from what a quick look at a spec file (jobs/spec_glance.py) or lm-eval's
  model_args tell, else by the first spec: a new local Ray's started at once, so the engines' imports run while
  the rest is checked; on a Ray cluster, one once Ray is joined where every node of it is on this machine; none
  for a reproducible run on vLLM. Ray's start begun at once where lm-eval builds tasks or requests (seconds) first;
- Ray started or joined once (the first sweep's step 4; a later sweep's finds it up), a local one with its reaper
  (jobs/ray_reaper.py) started first;
- with `keep_engines`, the actors of one sweep kept for the next (cluster/schedule/fleet.py KeptActors);
- `temporary_folder`: a folder removed at the end (named by this process: one a killed command left is removed by
  the next command that makes one).
Everything the run holds is put on one ExitStack as it is taken: the engine host, Ray (its stop closes the kept
actors first and releases its reaper after), the temporary folders (lm-eval's request cache in one, for a spec
with `lm_eval:` entries), each sweep's output sink (closed there where the sweep did not run to close it).
`close` (also on any error or signal) releases them once, in the reverse of the order they were taken.

Each sweep goes through the same steps, each once, in this order (`Phase`, the run's `phase`; a step out of order
is a bug, raised as one):
1. `read` (a spec file) or `adopt` (a spec already loaded): the spec read once;
2. `check`: every input checked once (cluster/inputs/checks.py), before the output is touched;
3. `open`: the output opened, the plan ready to stream (cluster/schedule/run.py `prepare`), or nothing left to run
   (an earlier run committed every shard);
4. `start_ray`: Ray started or joined (once, by the first sweep: a later one's finds it up); none for a sweep with
   nothing left to run;
5. `execute`: the sweep, watched for a lost head; with nothing left to run, its report from the output alone.
A bad input before the first sweep's step 4 leaves its output untouched and stops a Ray started early; no engine
has started. Nor has one for a sweep with nothing left to run: no early engine is asked for, no actor started.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable


def _printed(line: str) -> None:
    print(line, flush=True)


class Phase(enum.Enum):
    """Where a run stands: NEW, then for each sweep READ, CHECKED, OPENED, RAY_UP, EXECUTED; CLOSED at the end."""
    NEW = "new"
    READ = "read"  # a sweep's spec read or adopted
    CHECKED = "checked"  # its inputs checked
    OPENED = "opened"  # its output open, its plan streaming
    RAY_UP = "ray up"  # Ray started or joined
    EXECUTED = "executed"  # the sweep ran (it closed its sink itself)
    CLOSED = "closed"  # everything the run held released


STEP_AFTER = {Phase.CHECKED: Phase.READ, Phase.OPENED: Phase.CHECKED, Phase.RAY_UP: Phase.OPENED,
              Phase.EXECUTED: Phase.RAY_UP}  # each step's one phase before it (READ: any but CLOSED)


@dataclass
class _Sweep:
    """One sweep's own state, from its spec to its end."""
    spec: object  # its SweepSpec
    data: list | None = None  # its inputs, as `check` read them
    models: dict | None = None  # its models, as `check` found them (cluster/inputs/checks.py FoundModel, by name)
    prepared: object = None  # its output opened (cluster/schedule/run.py Prepared)
    executed: bool = False  # it ran: it closed its output's sink itself

    def close(self) -> None:
        """Its sink closed where it opened one and did not run (once: a sweep that ran closed its own)."""
        if self.prepared is not None and not self.executed:
            self.executed = True
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
        self.phase = Phase.NEW
        self._keep_engines = keep_engines
        self._ray_starting = None  # Ray's start on a thread of its own (jobs/background.py), where begun early
        self._ray_started = False
        self._reaper = None  # a local Ray's reaper (jobs/ray_reaper.py), released once this run stopped its Ray
        self._host_decided = False
        self._host_backends = None  # the engines' backends, where the host is decided once Ray is joined
        self._early = None  # the early engines asked of the engine host (cluster/plan/early_engines.py EarlyPlan)
        self._early_asked = False  # by the run's first sweep only: a later one finds engines kept or gone
        self._held = contextlib.ExitStack()  # what the run holds, released by close, the last taken first

    def _step(self, to: Phase) -> None:
        """The run's phase moved on to `to`: from the one phase before it (any but CLOSED for READ)."""
        before = STEP_AFTER.get(to)
        if self.phase is Phase.CLOSED or (before is not None and self.phase is not before):
            raise RuntimeError(f"run step {to.value!r} after {self.phase.value!r}: steps go "
                               "read, check, open, start_ray, execute")
        self.phase = to

    # -- the process's: the engine host, Ray's early start, temporary folders ------------------------------------
    def begin(self, backends: list[str], reproducible: bool = False, ray_early: bool = False) -> None:
        """The engine host decided (`_decide_host`). With `ray_early`, Ray's start begun on a thread of its own, once
        (lm-eval builds its tasks or requests while it starts)."""
        self._decide_host(backends, reproducible)
        if ray_early and not self.ray_begun:
            from jobs.background import Background

            self._held.callback(self._stop_ray)
            self._ray_starting = Background(self._start_ray, "raysweep-ray-start")

    def _decide_host(self, backends: list[str], reproducible: bool) -> None:
        """The engine host decided once, by the first call: started now for a new local Ray, else once Ray is joined
        (`_host_for_cluster`). None, and one started stopped, for a reproducible run on vLLM, told by any call (a
        spec that turns out so after a quick look): its actors keep their engines (cluster/launch.py)."""
        from cluster.launch import engines_in_actors

        if engines_in_actors(backends, reproducible):
            self._stop_host()
            self._host_backends = None
        elif not self._host_decided:
            if self.address == "local":
                self._start_host(backends)
            else:
                self._host_backends = backends  # decided once Ray is joined
        self._host_decided = True

    def temporary_folder(self, purpose: str) -> str:
        """A new folder, removed at close: `raysweep-PURPOSE-PID-*` in the temporary folder; those of the same
        purpose whose command no longer runs (killed before its close) are removed now."""
        import shutil
        import tempfile

        from cluster.launch import remove_stale_folders

        prefix = f"raysweep-{purpose}-"
        folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        self._held.callback(shutil.rmtree, folder, True)
        remove_stale_folders(os.path.dirname(folder), prefix)
        return folder

    # -- 1. the spec ---------------------------------------------------------------------------------------
    def read(self, path: str):
        """The spec file, loaded once. Before that, a quick look at its YAML begins the process's part: the
        engine host and, for a spec with `lm_eval:` entries, Ray (lm-eval builds its tasks while they start)."""
        import importlib.util

        from cluster.inputs.spec_file import load_spec
        from cluster.lm_eval.adapter import own_request_cache
        from jobs.silence import watched
        from jobs.spec_glance import backends_named, names_lm_eval_tasks, quick_look

        raw = quick_look(path)
        lm_eval = raw is not None and names_lm_eval_tasks(raw)
        if raw is not None:
            self.begin(backends_named(raw), raw.get("reproducible") is True, lm_eval)
        if lm_eval and importlib.util.find_spec("lm_eval") is not None:  # lm-eval's request cache the run's own
            self._held.enter_context(own_request_cache(self.temporary_folder("lm-eval-requests")))
        with watched(self.log, "lm-eval indexes and loads its tasks and builds their requests" if lm_eval else
                     "the spec read"):
            spec = load_spec(path)
        return self.adopt(spec)

    def adopt(self, spec):
        """A spec already loaded (`verify` builds one; lm-eval's model makes one per request type): a new sweep.
        Its engine host decided here where `begin` did not, or stopped where the spec turned out reproducible on vLLM
        (its actors run their own engines)."""
        self._step(Phase.READ)
        if self.sweep is not None:
            self.sweep.close()
        self._decide_host([m.backend for m in spec.models], spec.reproducible)
        self.sweep = _Sweep(spec)
        self._held.callback(self.sweep.close)
        return spec

    @property
    def spec(self):
        return self.sweep.spec if self.sweep is not None else None

    # -- 2, 3. the inputs and the output ---------------------------------------------------------------------
    def check(self) -> None:
        from cluster.inputs.checks import check_inputs
        from jobs.ray_start import check_ray_address

        self._step(Phase.CHECKED)
        spec = self.sweep.spec
        checked = check_inputs(spec)
        self.sweep.data, self.sweep.models = checked.data, checked.models
        self.log(f"[raysweep] inputs checked: {len(self.sweep.data)} task(s), "
                 f"{sum(d.n_rows for d in self.sweep.data)} rows, {len(spec.models)} model(s) "
                 f"({time.time() - self.clock.started_at:.1f}s after the command started)")
        if self._ray_starting is None and not self._ray_started:
            check_ray_address(self.address, self.named)

    def _ask_early(self, spec) -> None:
        """The early engines of the run's first sweep asked of the engine host, where it has shards left to run, the
        actors' first engines are known before Ray is up (cluster/plan/early_engines.py), and the model is on disk (a
        builtin model not built yet is built by the planner: none then), as the checks found it."""
        if self._early_asked or self.host is None:
            return
        self._early_asked = True
        if self.sweep.prepared.nothing_left:  # none built for nothing; a later sweep's engines start with its actors
            return
        from cluster.plan.early_engines import local_gpu_bytes, local_gpus, plan_early

        found = self.sweep.models[spec.models[0].name] if len(spec.models) == 1 else None
        gpus = local_gpus()
        plan = found and found.on_disk and plan_early(spec, found.on_disk, gpus, found.weight_bytes(),
                                                      local_gpu_bytes(gpus))
        if not plan:
            return
        try:
            self.host.start_early(plan.engines)
        except OSError as e:  # a socket that cannot be bound or a host that went: the actors build their own
            self.host.drop_early()
            self.log(f"[raysweep] no engine started before Ray was up ({type(e).__name__}: {e}); each actor starts "
                     "its own")
            return
        self._early = plan

    def _fleet_sized(self, size, lent) -> None:
        """The fleet sized once Ray was up: the early engines let go of where its actors are not those planned."""
        plan, self._early = self._early, None
        if plan is not None and self.host is not None and not plan.holds(size, lent):
            self.host.drop_early()
            self.log(f"[raysweep] the {len(plan.engines)} engine(s) started before Ray was up were let go of: "
                     f"the actors are not those planned ({size.engines.reason})")

    def open(self, output: str) -> None:
        """The output opened and the plan made ready: the expensive part (models, tokenizers, tokens, shards) runs
        on the planner's thread from the checked data while the actors start (cluster/schedule/run.py)."""
        from cluster.schedule.run import prepare

        self._step(Phase.OPENED)
        self.sweep.prepared = prepare(self.sweep.spec, self.sweep.data, output, self.args.new_run, background=True)
        self._ask_early(self.sweep.spec)

    @property
    def sink(self):
        return self.sweep.prepared.sink if self.sweep is not None and self.sweep.prepared is not None else None

    @property
    def all_committed(self) -> bool:
        """Whether every shard of the sweep under way is planned and committed (its output's manifest says)."""
        prepared = self.sweep.prepared if self.sweep is not None else None
        if prepared is None:  # asked from a signal's handler, maybe mid-import of the modules imported below
            return False
        from cluster.plan.plan_source import planned_pairs  # imported by then: the output was opened through it
        try:
            return prepared.sink.nothing_left(planned_pairs(prepared.spec))
        except RuntimeError:  # asked from a signal's handler while a commit changed the manifest: not known, so not
            return False

    # -- 4, 5. Ray and the sweep -------------------------------------------------------------------------------
    @property
    def ray_begun(self) -> bool:
        """Whether this process's Ray was started or joined, or its start begun."""
        return self._ray_starting is not None or self._ray_started

    def _start_ray(self) -> None:
        from jobs import local_ray
        from jobs.ray_start import check_ray_address, start_ray

        check_ray_address(self.address, self.named)
        if self.address == "local":
            self._reaper = local_ray.reaper()  # what this Ray starts ends with the command, even a command killed
        start_ray(self.address, self.named, self.args.dashboard, self.args.verbose)
        self.clock.mark("ray_start")  # when it came up, also where it started early (on a thread of its own)

    def start_ray(self) -> None:
        """Ray started or joined (or its early start waited for), by the first sweep; a later sweep finds it up.
        None for a sweep with nothing left to run (a start begun early is stopped at close)."""
        from jobs.interrupts import Interrupted, reclaim

        self._step(Phase.RAY_UP)
        if self._ray_started or self.sweep.prepared.nothing_left:
            return
        if not self.ray_begun:
            self._held.callback(self._stop_ray)
        self._ray_started = True
        try:
            if self._ray_starting is not None:
                self._ray_starting.result()
            else:
                self._start_ray()
            reclaim()  # Ray's core worker took SIGTERM over: ours again, so it ends the run in one line
            self._host_for_cluster()
        except SystemExit as e:  # ray.init's own SIGTERM handler: sys.exit(15), no word
            if e.code == signal.SIGTERM:
                raise Interrupted(signal.SIGTERM) from None
            raise
        self.clock.mark("ray_start", once=True)
        self.log(f"[raysweep] Ray is up ({self.clock.record()['ray_start_s']:.1f}s after the command started); "
                 "actors starting")

    def execute(self, say_stopped):
        """The sweep on the started Ray, its head watched (lost: `say_stopped`'s line, exit 1, in about a
        second): the report, and the driver's node where a local output sits on one node of several. With nothing
        left to run, the report alone (no Ray: no node)."""
        import ray

        from cluster.schedule.run import execute
        from jobs.head_watch import head_watched

        self._step(Phase.EXECUTED)
        if self._keep_engines and self.kept is None:
            from cluster.schedule.fleet import KeptActors

            self.kept = KeptActors()
        self.sweep.executed = True
        if self.sweep.prepared.nothing_left:
            return execute(self.sweep.prepared, log=self.log, clock=self._sweep_clock()), None
        with head_watched(say_stopped):
            report = execute(self.sweep.prepared, log=self.log, max_attempts=self.args.max_attempts,
                             clock=self._sweep_clock(), kept=self.kept,
                             engine_host=self.host.address if self.host is not None else None,
                             fleet_sized=self._fleet_sized)
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
        """Everything the run holds released, once, the last taken first (the module's docstring says what)."""
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.CLOSED
            self._held.close()

    def _stop_ray(self) -> None:
        """This process's Ray stopped: a start still under way waited for first (a half-started local Ray leaves
        nothing), the actors kept on it closed before it stops; then its reaper released (nothing of it is left to
        kill). A stop that fails leaves the reaper to end what is left when this process ends."""
        from jobs import local_ray

        if self._ray_starting is not None:
            try:
                self._ray_starting.result()
            except BaseException:  # noqa: BLE001  (the run's own error is the one said)
                pass
        self._ray_starting, self._ray_started = None, False
        try:
            import ray

            if self.kept is not None and ray.is_initialized():  # else Ray's own exit stopped them with it
                self.kept.close()
        finally:
            local_ray.shutdown()
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None

    def _start_host(self, backends) -> None:
        from cluster.launch import start_engine_host

        self.host = start_engine_host(backends)  # RAYSWEEP_ENGINE_HOST=0: none (cluster/launch.py)
        self._held.callback(self._stop_host)

    def _host_for_cluster(self) -> None:
        """Once a Ray cluster is joined: an engine host where every node of it runs on this machine and no
        autoscaler can add one elsewhere (a workstation's `ray start`), so every actor reaches it; else none."""
        from cluster.launch import cluster_on_this_machine

        backends, self._host_backends = self._host_backends, None
        if backends is not None and cluster_on_this_machine():
            self._start_host(backends)

    def _stop_host(self) -> None:
        if self.host is not None:
            self.host.stop()
            self.host = None

    def __enter__(self) -> "SweepRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
