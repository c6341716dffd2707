"""`raysweep lm-eval ARGS`: lm-eval's own command line (`lm_eval ARGS`), with raysweep registered as its model
`raysweep`, so an lm-eval user keeps their command and gets raysweep's engines and distribution:

    raysweep lm-eval --model raysweep --model_args pretrained=builtin:tiny,actors=2 --tasks arc_easy ...

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so plain `lm_eval --model
raysweep` cannot find it; `raysweep lm-eval` (jobs/lm_eval_command.py) registers it, runs lm-eval's CLI on the
rest of the line inside an LmEvalRun (jobs/lm_eval_run.py), and closes that run at its end. From Python,
`import jobs.lm_eval_model` registers it for `lm_eval.simple_evaluate(model="raysweep", ...)` (a model made there
has a run of its own, closed when the model goes).

The models made in one command share its run's one SweepRun (jobs/lifecycle.py): the engine host decided and Ray's
start begun once lm-eval has loaded its tasks (a dataset that cannot be reached is said before Ray starts), while
it builds their requests (`begin`), and the teardown (the kept actors, Ray, the engine host, the temporary output)
in the run's `close`. Each request type lm-eval asks for (loglikelihood, loglikelihood_rolling, generate_until)
is one raysweep sweep through the steps `raysweep run`'s takes (adopt, check, open, start_ray, execute): the
requests made into rows by the rule a spec's `lm_eval:` entry uses (cluster/lm_eval/run.py), sharded over the
model's actors, and answered from the committed rows (cluster/lm_eval/scores.py). The first sweep's actors stay up
with their engines for the next request types (cluster/schedule/fleet.py KeptActors): the engines start once per
command.
model_args: pretrained (a model folder, hub id or builtin:NAME; also `model`), max_model_len, backend
(auto | hf | vllm), actors (per model) and num_gpus (per actor) (default `auto` for each: chosen as for a spec
without `actors:`, cluster/plan/engines_per_gpu.py, e.g. two engines on a large GPU for a small model), address
(a Ray cluster; default: a local Ray), output (where the sweeps' results stay, and resume from; default: a
temporary folder, removed when the command ends).

A model_args value or an lm-eval option that cannot be used (`--tasks` naming no task, `actors=0`) is one line
at the edge, `raysweep: error: ...` (LmEvalError), as raysweep's own commands say theirs.
"""

from __future__ import annotations

import hashlib
import os
import re
import weakref
from collections import defaultdict

from cluster.lm_eval.answered import AnsweredLM
from jobs.lm_eval_run import LmEvalError, LmEvalRun, current_run, said

NAME = "raysweep"

# what lm-eval's command line hands every model beside --model_args (lm_eval.evaluator.simple_evaluate)
LM_EVAL_OPTIONS = {"batch_size", "max_batch_size", "device"}


class RaysweepLM(AnsweredLM):
    def __init__(self, pretrained: str | None = None, model: str | None = None, max_model_len: int | None = None,
                 backend: str = "auto", actors: int | str = "auto", num_gpus: float | str = "auto",
                 address: str | None = None, output: str | None = None, **lm_eval_options):
        super().__init__()
        from cluster.contracts.spec import ActorSpec, ModelSpec

        unknown = sorted(set(lm_eval_options) - LM_EVAL_OPTIONS)
        if unknown:  # lm-eval's header prints model_args as given: one raysweep ignored would mislead
            raise LmEvalError(f"--model_args: {unknown[0]} is not one raysweep takes (it takes pretrained, "
                              "model, max_model_len, backend, actors, num_gpus, address, output)")
        path = pretrained or model
        if not path:
            raise LmEvalError("--model_args: raysweep needs pretrained=PATH (a model folder, hub id or builtin:NAME)")
        from cluster.contracts.model_paths import is_local_path

        if is_local_path(str(path)) and not os.path.isdir(os.path.expanduser(str(path))):  # before Ray starts
            raise LmEvalError(f"--model_args: pretrained={path}: no such directory")
        length = _auto(max_model_len, int, "max_model_len")
        engine = {"max_model_len": length} if length is not None else {}
        name = re.sub(r"[^A-Za-z0-9._-]", "_", str(path).rstrip("/").split("/")[-1].split(":")[-1]).lstrip("._-")
        try:  # the specs' own checks, said with model_args' names (actors, not count; max_model_len)
            # one engine for both kinds of request (kept between their sweeps), and lm-eval's log-likelihoods
            self.model = ModelSpec(name=name or "model", path=str(path), backend=backend, engine=engine,
                                   loglikelihood=True)
            self.actors = ActorSpec(count=_auto(actors, int, "actors"), num_gpus=_auto(num_gpus, float, "num_gpus"))
        except LmEvalError:
            raise
        except ValueError as e:
            raise LmEvalError("--model_args: " + re.sub(r"^(engine\.|count:)", lambda m: "actors:" if
                                                         m.group(1) == "count:" else "", str(e))) from None
        self.run = current_run()
        if self.run is None:  # made by lm-eval's simple_evaluate from Python: a run of its own, closed with it
            self.run = LmEvalRun()
            weakref.finalize(self, self.run.close, True)
        self.life = self.run.sweep_run(address)
        self.output_kept = output is not None  # the user's folder stays; the default, a temporary one, goes
        self.output = output or self.life.temporary_folder("lm-eval-output")
        if self.output_kept:
            self.run.outputs.append(output)
        from cluster.inputs.model_files import tokenizer_and_length

        folder = _folder(str(path))
        self.described(*tokenizer_and_length(folder, length))  # lm-eval's results record them, as its vLLM model's
        _chat_templated(self, folder)
        said("model made; lm-eval loads its tasks")
        self.run.stage("lm-eval loads its tasks (their documents)")

    @property
    def tokenizer_name(self) -> str:
        """Asked by lm-eval only under --apply_chat_template; a model with a chat template answers it
        (cluster/lm_eval/answered.py `templated`), one without is one line here, not lm-eval's traceback."""
        if self.chat_tokenizer is None:
            raise LmEvalError(f"--apply_chat_template: model {self.model.path}: {self.no_chat_template}")
        return super().tokenizer_name

    def begin(self) -> None:
        """The engine host decided (the engines' imports start) and Ray's start begun, on a thread of its own: once
        lm-eval loaded its tasks, while it builds their requests (they need only this thread's Python; ray.init
        mostly waits on the processes it starts). The first request type's sweep waits for it. Called by the
        command when lm-eval goes from its tasks to their requests (cluster/lm_eval/adapter.py on_evaluate)."""
        if not self.life.ray_begun:
            self.life.begin([self.model.backend], ray_early=True)
            said("tasks loaded; Ray starting while lm-eval builds its requests")
            self.run.stage("lm-eval builds its tasks' requests")

    def _answers(self, kind: str, requests) -> dict:
        """One sweep over the requests, through the run's SweepRun; the committed rows by task and (sample id,
        completion)."""
        from cluster.contracts.lm_eval_task import LmEvalSettings
        from cluster.contracts.spec import SweepSpec
        from cluster.lm_eval.run import request_rows
        from cluster.lm_eval.requests import task_spec
        from cluster.store.output_files import SinkError

        by_task = defaultdict(list)
        for r in requests:
            by_task[r.task_name].append(r)
        rows = request_rows(requests)
        try:  # what raysweep cannot run (beam search, a generation argument it does not pass): one line
            tasks = tuple(task_spec(name, reqs, rows.get(name, []), LmEvalSettings(tasks=(name,)), entry=-1)
                          for name, reqs in by_task.items())
        except ValueError as e:
            raise LmEvalError(f"task {e}") from None
        said(f"{kind}: {len(requests)} request(s) of {len(by_task)} task(s) made into rows")
        self.run.stage(None)  # the sweep says its own progress
        digest = hashlib.sha256(repr(tasks).encode()).hexdigest()[:8]
        spec = SweepSpec(name=f"lm-eval-{kind.replace('_', '-')}-{digest}", output=os.path.join(self.output, kind),
                         models=(self.model,), tasks=tasks, actors=self.actors,
                         source="--model_args")  # what its refusals name: the model and its settings came from there
        life = self.life
        life.adopt(spec)
        life.check()
        try:
            life.open(spec.output)
        except SinkError as e:  # the output refused (another spec's results ...): advice this command can follow
            raise type(e)(lm_eval_advice(str(e), self.output)) from None
        life.start_ray()
        report, _ = life.execute(self.run.say_stopped)  # a local Ray's head lost: one line, exit 1
        if report.failed:
            first = next(iter(report.failed.values()))["errors"][-1]
            kept = (f"the run's output {spec.output} keeps what was committed: the same command resumes it"
                    if self.output_kept else "pass output=DIR in --model_args to keep what is committed and "
                    "resume it")
            raise RuntimeError(f"raysweep: {len(report.failed)} shard(s) failed (first: {first}); {kept}")
        answers = _read_answers(spec.output, self.model.name, [t.name for t in tasks])
        said(f"{kind}: answers read; back to lm-eval")
        self.run.stage("lm-eval scores the answers or builds its next requests")
        return answers

    def _answer(self, kind: str, requests) -> list:
        from cluster.lm_eval.scores import replay_lm

        return getattr(replay_lm(self._answers(kind, requests)), kind)(requests)


def _auto(value, kind, name: str):
    """A model_args value: `auto` (or left out) is None, for raysweep to choose; else `kind` of it."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    what = "an integer" if kind is int else "a number"
    try:
        number = float(value)  # lm-eval reads `actors=2.9` as a float, which int() would cut to 2
    except ValueError:
        number = None
    if number is None or (kind is int and not number.is_integer()):
        raise LmEvalError(f"--model_args: {name} must be auto or {what}, got {value!r}")
    return kind(number)


def lm_eval_advice(message: str, output: str) -> str:
    """A refusal of an output (another spec's results, changed data, a damaged file) with advice `raysweep
    lm-eval` can follow: it has no --new-run; another output= in --model_args, or that folder (`output`, every request
    type's results) removed, does that. A request type's sweep is named by its requests, so a spec named otherwise
    means requests made otherwise."""
    return message.replace("holds results of another spec: name changed", "holds results of other lm-eval requests "
                           "(tasks or settings changed: --tasks, --limit, --num_fewshot, ...)").replace(
        "use a new output", "use another output= in --model_args").replace("--new-run", f"remove the folder {output}")


def _folder(path: str) -> str:
    """`pretrained`'s model folder (a builtin model built), or its hub id."""
    from cluster.inputs.builtin_model import resolve_model_path

    try:
        return resolve_model_path(path)
    except ValueError as e:  # an unknown builtin model
        raise LmEvalError(f"--model_args: pretrained: {e}") from None


def _chat_templated(lm, folder: str) -> None:
    """The model's chat template for lm-eval's --apply_chat_template, where its tokenizer has one. The tokenizer
    loads when lm-eval first asks for the template, not here (transformers' import and the load took seconds
    before lm-eval could build its requests): a model folder's files say whether it has a template."""
    found = has_chat_template(folder)
    lm.no_chat_template = "its tokenizer has no chat template"
    if found is False:
        return
    if found is None:  # not a folder here (a hub id): loaded now, to know
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:  # not in the cache: said if a chat template is asked for
            from cluster.plan.plan_source import one_line

            lm.no_chat_template = f"its tokenizer cannot be loaded: {one_line(e)}"
            return
        if getattr(tokenizer, "chat_template", None):
            lm.templated(tokenizer)
        return
    lm.templated(lm.tokenizer)  # loaded when lm-eval first asks for the template (`described`)


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


def _read_answers(output: str, model: str, tasks: list[str]) -> dict:
    import pyarrow.parquet as pq

    from cluster.lm_eval.scores import ANSWER_COLUMNS

    answers = {}
    for task in tasks:
        table = pq.read_table(os.path.join(output, "results", model, task), columns=list(ANSWER_COLUMNS))
        answers[task] = {(r["sample_id"], r["completion"]): r for r in table.to_pylist()}
    return answers


def register() -> None:
    """raysweep as lm-eval's model `raysweep` (its own models stay registered beside it), as lm-eval registers its
    own (`@register_model`)."""
    import lm_eval.models  # noqa: F401  (lm-eval loads its models only while its registry is empty)
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry.keys():
        model_registry.register(NAME)(RaysweepLM)


register()  # `import jobs.lm_eval_model` registers the model, for `lm_eval.simple_evaluate(model="raysweep", ...)`
