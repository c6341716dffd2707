"""`raysweep lm-eval ARGS`: lm-eval's own command line (`lm_eval ARGS`), with raysweep registered as its model
`raysweep`, so an lm-eval user keeps their command and gets raysweep's engines and distribution:

    raysweep lm-eval --model raysweep --model_args pretrained=builtin:tiny,actors=2 --tasks arc_easy ...

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so plain `lm_eval --model
raysweep` cannot find it; `raysweep lm-eval` registers it, then runs lm-eval's CLI on the rest of the line.
From Python, `import jobs.lm_eval_model` does the same for `lm_eval.simple_evaluate(model="raysweep", ...)`.

Each request type lm-eval asks for (loglikelihood, loglikelihood_rolling, generate_until) is one raysweep
sweep: the requests made into rows by the rule a spec's `lm_eval:` entry uses (cluster/harness/lm_eval_run.py),
sharded over the model's actors, and answered from the committed rows (cluster/score/lm_eval_scores.py). The
first sweep's actors stay up with their engines for the next request types (cluster/schedule/kept.py): the
engines start once per command.
model_args: pretrained (a model folder, hub id or builtin:NAME; also `model`), max_model_len, backend
(auto | hf | vllm), actors (per model) and num_gpus (per actor) (default `auto` for each: chosen as for a spec
without `actors:`, cluster/plan/engines_per_gpu.py, e.g. two engines on a large GPU for a small model), address
(a Ray cluster; default: a local Ray), output (where the sweeps' results stay, and resume from; default: a
temporary folder).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import sys
import tempfile
import time
from collections import defaultdict

from jobs.background import Background

NAME = "raysweep"


def make_model_class():
    from lm_eval.api.model import LM

    class RaysweepLM(LM):
        def __init__(self, pretrained: str | None = None, model: str | None = None, max_model_len: int | None = None,
                     backend: str = "auto", actors: int | str = "auto", num_gpus: float | str = "auto",
                     address: str | None = None,
                     output: str | None = None, **lm_eval_options):
            super().__init__()
            from cluster.contracts.spec import ActorSpec, ModelSpec

            path = pretrained or model
            if not path:
                raise ValueError("--model_args: raysweep needs pretrained=PATH (a model folder, hub id or builtin:NAME)")
            engine = {"max_model_len": int(max_model_len)} if max_model_len else {}
            name = re.sub(r"[^A-Za-z0-9._-]", "_", str(path).rstrip("/").split("/")[-1].split(":")[-1]).lstrip("._-")
            self.model = ModelSpec(name=name or "model", path=str(path), backend=backend, engine=engine)
            self.actors = ActorSpec(count=_auto(actors, int, "actors"), num_gpus=_auto(num_gpus, float, "num_gpus"))
            self.output = output or tempfile.mkdtemp(prefix="raysweep-lm-eval-")
            self.address = address or os.environ.get("RAY_ADDRESS") or "local"
            self._kept = None  # the engines of the first request type's sweep, kept for the next ones
            self._host = None  # a local run's engine host (cluster/launch.py): the engines' imports start now
            if self.address == "local":
                from cluster.launch import start_engine_host

                self._host = start_engine_host([backend])
                if self._host is not None:
                    atexit.register(self._host.stop)  # registered before Ray's and the engines': runs after them
            # Ray starts while lm-eval loads its tasks and builds their requests (they need only this thread's
            # Python; ray.init mostly waits on the processes it starts); the first request type waits for it
            self._ray = Background(self._start_ray, "raysweep-ray-start")
            _chat_templated(self, str(path))
            _said("model made (Ray starting meanwhile); lm-eval builds its requests")

        def _answers(self, kind: str, requests) -> dict:
            """One sweep over the requests; the committed rows by task and (sample id, completion)."""
            from cluster.contracts.lm_eval_task import LmEvalSettings
            from cluster.contracts.spec import SweepSpec
            from cluster.harness.lm_eval_run import request_rows
            from cluster.inputs.lm_eval_tasks import task_spec
            from cluster.schedule.run import execute, prepare

            by_task = defaultdict(list)
            for r in requests:
                by_task[r.task_name].append(r)
            rows = request_rows(requests)
            tasks = tuple(task_spec(name, reqs, rows.get(name, []), LmEvalSettings(tasks=(name,)), entry=-1)
                          for name, reqs in by_task.items())
            _said(f"{kind}: {len(requests)} request(s) of {len(by_task)} task(s) made into rows")
            digest = hashlib.sha256(repr(tasks).encode()).hexdigest()[:8]
            spec = SweepSpec(name=f"lm-eval-{kind.replace('_', '-')}-{digest}", output=os.path.join(self.output, kind),
                             models=(self.model,), tasks=tasks, actors=self.actors)
            self._ray.result()
            report = execute(prepare(spec, spec.output), log=lambda line: print(line, file=sys.stderr, flush=True),
                             kept=self._kept, engine_host=self._host.address if self._host is not None else None)
            if report.failed:
                first = next(iter(report.failed.values()))["errors"][-1]
                raise RuntimeError(f"raysweep: {len(report.failed)} shard(s) failed (first: {first}); the run's "
                                   f"output {spec.output} keeps what was committed: the same command resumes it")
            answers = _read_answers(spec.output, self.model.name, [t.name for t in tasks])
            _said(f"{kind}: answers read; back to lm-eval")
            return answers

        def _start_ray(self) -> None:
            from jobs import local_ray
            from jobs.sweep import check_ray_address, start_ray

            from cluster.schedule.kept import KeptActors

            check_ray_address(self.address, "address")
            start_ray(self.address, "address", dashboard=False)
            _said("Ray is up")
            self._kept = KeptActors()
            atexit.register(local_ray.shutdown)
            atexit.register(self._kept.close)  # atexit runs last in, first out: the engines close before Ray
            atexit.register(_said, "lm-eval is done: the engines and Ray close")

        def _replay(self, kind: str, requests):
            from cluster.score.lm_eval_scores import replay_lm

            return getattr(replay_lm(self._answers(kind, requests)), kind)(requests)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self._replay("loglikelihood", requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self._replay("loglikelihood_rolling", requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self._replay("generate_until", requests)

    return RaysweepLM


def _said(what: str) -> None:
    """One stage of the command, timed from its Python's start as the spec path's lines are (jobs/sweep.py)."""
    from jobs import started_at

    when = f" ({time.time() - started_at():.1f}s after the command started)"
    print(f"[raysweep] lm-eval: {what}{when}", file=sys.stderr, flush=True)


def _auto(value, kind, name: str):
    """A model_args value: `auto` (or left out) is None, for raysweep to choose; else `kind` of it."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"--model_args: {name} must be auto or a number, got {value!r}") from None


def _chat_templated(lm, path: str) -> None:
    """The model's chat template for lm-eval's --apply_chat_template, where its tokenizer has one. The tokenizer
    loads when lm-eval first asks for the template, not here (transformers' import and the load took seconds
    before lm-eval could build its requests): a model folder's files say whether it has a template."""
    from cluster.harness.lm_eval_run import with_chat_template
    from cluster.inputs.builtin_model import resolve_model_path

    folder = resolve_model_path(path)
    found = has_chat_template(folder)
    if found is False:
        return
    if found is None:  # not a folder here (a hub id): loaded now, to know
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError):  # not in the cache: lm-eval says so if a chat template is asked for
            return
        if getattr(tokenizer, "chat_template", None):
            with_chat_template(lm, tokenizer)
        return
    with_chat_template(lm, _LoadedOnUse(folder))


def has_chat_template(folder: str) -> bool | None:
    """Whether a model folder's tokenizer has a chat template, where transformers looks for one (the
    tokenizer config's `chat_template`, a chat_template.jinja or .json file); None: not a folder."""
    import json

    if not os.path.isdir(folder):
        return None
    if any(os.path.exists(os.path.join(folder, name)) for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


class _LoadedOnUse:
    """A model folder's tokenizer, loaded at its first attribute read."""

    def __init__(self, folder: str):
        self._folder, self._tokenizer = folder, None

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_folder", "_tokenizer"):  # copy and pickle probes; before __init__
            raise AttributeError(name)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._folder)
        return getattr(self._tokenizer, name)


def _read_answers(output: str, model: str, tasks: list[str]) -> dict:
    import pyarrow.parquet as pq

    from cluster.score.lm_eval_scores import ANSWER_COLUMNS

    answers = {}
    for task in tasks:
        table = pq.read_table(os.path.join(output, "results", model, task), columns=list(ANSWER_COLUMNS))
        answers[task] = {(r["sample_id"], r["completion"]): r for r in table.to_pylist()}
    return answers


def task_names(argv: list[str]) -> list[str]:
    """The task names of lm-eval's `--tasks a,b` (or `--tasks a b`, `--tasks=a,b`) on `argv`."""
    names, taking = [], False
    for arg in argv:
        if arg.startswith("--tasks="):
            names += arg.split("=", 1)[1].split(",")
            taking = False
        elif arg in ("--tasks", "-t"):
            taking = True
        elif taking and not arg.startswith("-"):
            names += arg.split(",")
        else:
            taking = False
    return [name.strip() for name in names if name.strip()]


def register() -> None:
    """raysweep as lm-eval's model `raysweep` (its own models stay registered beside it)."""
    import lm_eval.models  # noqa: F401  (lm-eval loads its models only while its registry is empty)
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry.keys():
        model_registry.register(NAME)(make_model_class())


def run(argv: list[str]) -> int:
    """lm-eval's command line on `argv`, with raysweep registered; each Jinja template of its tasks compiled
    once, and lm-eval's own tasks not indexed where --include_path holds every task named (cluster/harness/
    lm_eval_run.py templates_compiled_once, own_tasks_indexed)."""
    from cluster.harness.lm_eval_run import import_lm_eval, own_tasks_indexed, templates_compiled_once

    try:
        import_lm_eval()
    except ValueError as e:  # not installed: one line naming the extra
        print(f"raysweep: error: {e}", file=sys.stderr)
        return 2
    register()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    with templates_compiled_once(), own_tasks_indexed(task_names(argv)):
        cli_evaluate()
    return 0


try:  # `import jobs.lm_eval_model` registers the model where lm-eval is installed
    register()
except ImportError:
    pass
