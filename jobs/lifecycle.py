"""One sweep from the command to its exit (`SweepRun`), for `raysweep run`, `ray job submit` (both
`python -m jobs.sweep`) and `raysweep verify`'s second run.

Each step happens once, in this order, and `close` undoes what was done, in one place:
1. `read` (a spec file) or `adopt` (a spec already loaded): the spec read once; the engine host decided once
   (a new local Ray's, started at once so the engines' imports run while the rest is checked; none on a Ray
   cluster or for a reproducible run); Ray's start begun at once where lm-eval builds tasks (seconds) first;
2. `check`: every input checked once (cluster/inputs/checks.py), before the output is touched;
3. `open`: the output opened, the plan ready to stream (cluster/schedule/run.py `prepare`);
4. `start_ray`: Ray started or joined, once;
5. `execute`: the sweep, watched for a lost head;
6. `close` (also on any error or signal): the output's sink, this process's Ray, the engine host.
A bad input before step 4 leaves the output untouched and stops a Ray started early; no engine has started.
"""

from __future__ import annotations

import argparse
import os
import signal
import time


class SweepRun:
    def __init__(self, args: argparse.Namespace, clock):
        self.args, self.clock = args, clock
        self.address = args.address or os.environ.get("RAY_ADDRESS") or "local"
        self.named = "--address" if args.address else "RAY_ADDRESS"
        self.spec = self.data = self.prepared = self.host = None
        self._ray_starting = None  # Ray's start on a thread of its own (jobs/background.py), where begun early
        self._ray_started = False
        self._host_decided = False
        self._executed = False  # the sweep ran: it closed the output's sink itself

    # -- 1. the spec ---------------------------------------------------------------------------------------
    def read(self, path: str):
        """The spec file, loaded once. Before that, a quick look at its YAML starts the engine host and, for a
        spec with `lm_eval:` entries, Ray (lm-eval builds its tasks while they start)."""
        from cluster.inputs.spec_file import load_spec

        raw = quick_look(path)
        if raw is not None:
            self._decide_host(raw.get("reproducible") is True, backends_named(raw))
            if names_lm_eval_tasks(raw):
                self._begin_ray()
        return self.adopt(load_spec(path))

    def adopt(self, spec):
        """A spec already loaded (`verify` builds one): its engine host decided here where the quick look did
        not, or stopped where the spec turned out reproducible (its actors run their own engines)."""
        self.spec = spec
        if self.host is not None and spec.reproducible:
            self.host.stop()
            self.host = None
        elif not self._host_decided:
            self._decide_host(spec.reproducible, [m.backend for m in spec.models])
        return spec

    def _decide_host(self, reproducible: bool, backends: list[str]) -> None:
        self._host_decided = True
        if self.address == "local" and not reproducible:  # RAYSWEEP_ENGINE_HOST=0: none (cluster/launch.py)
            from cluster.launch import start_engine_host

            self.host = start_engine_host(backends)

    # -- 2, 3. the inputs and the output ---------------------------------------------------------------------
    def check(self) -> None:
        from cluster.inputs.checks import check_inputs
        from jobs.ray_start import check_ray_address

        self.data = check_inputs(self.spec)
        print(f"[raysweep] inputs checked: {len(self.data)} task(s), {sum(d.n_rows for d in self.data)} rows, "
              f"{len(self.spec.models)} model(s) ({time.time() - self.clock.started_at:.1f}s after the command "
              "started)", flush=True)
        if self._ray_starting is None:
            check_ray_address(self.address, self.named)

    def open(self, output: str) -> None:
        """The output opened and the plan made ready: the expensive part (models, tokenizers, tokens, shards) runs
        on the planner's thread from the checked data while the actors start (cluster/schedule/run.py)."""
        from cluster.schedule.run import prepare

        self.prepared = prepare(self.spec, output, self.args.new_run, background=True, data=self.data)

    @property
    def sink(self):
        return self.prepared.sink if self.prepared is not None else None

    # -- 4, 5. Ray and the sweep -------------------------------------------------------------------------------
    def _begin_ray(self) -> None:
        from jobs.background import Background

        self._ray_starting = Background(self._start_ray, "raysweep-ray-start")

    def _start_ray(self) -> None:
        from jobs.ray_start import check_ray_address, start_ray

        check_ray_address(self.address, self.named)
        start_ray(self.address, self.named, self.args.dashboard, self.args.verbose)

    def start_ray(self) -> None:
        from jobs.interrupts import Interrupted, reclaim

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
        self.clock.mark("ray_start")
        print(f"[raysweep] Ray is up ({self.clock.record()['ray_start_s']:.1f}s after the command started); "
              "actors starting", flush=True)

    def execute(self, say_stopped):
        """The sweep on the started Ray, its head watched (lost: `say_stopped`'s line, exit 1, in about a
        second): the report, and the driver's node where a local output sits on one node of several."""
        import ray

        from cluster.schedule.run import execute
        from jobs.head_watch import head_watched

        self._executed = True
        with head_watched(say_stopped):
            report = execute(self.prepared, max_attempts=self.args.max_attempts, clock=self.clock,
                             engine_host=self.host.address if self.host is not None else None)
            node = ray.util.get_node_ip_address() if "://" not in report.output and len(ray.nodes()) > 1 else None
        return report, node

    # -- 6. the end ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """What this run opened, closed: the sink where the sweep did not close it (a failure before it ran),
        this process's Ray (a start still under way waited for first: a half-started local Ray leaves nothing),
        the engine host."""
        from jobs import local_ray

        try:
            if self.sink is not None and not self._executed:
                self.sink.close()
            if self._ray_starting is not None:
                try:
                    self._ray_starting.result()
                except BaseException:  # noqa: BLE001  (the run's own error is the one said)
                    pass
            if self._ray_starting is not None or self._ray_started:
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
