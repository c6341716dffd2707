"""Preflight then planning (docs/design.md, Planning), as a stream the scheduler consumes while it runs.

1. The cheap checks ran before (cluster/inputs/checks.py `check_inputs`: the data it returned is planned here).
2. Each model loaded once per folder (`load_models`: its tokenizer and length; every structured spec compiled
   against that tokenizer, as the engines will): a problem is one line naming the model or task, before any
   actor starts an engine. Then one `ModelReady` per model: from here its actors may start.
3. Then one `TaskPlan` per model x task, as each is planned (prompts measured in tokens, the length
   policy applied, shards cut): the scheduler dispatches a task's shards as soon as its plan arrives.
   A prompt refused by the length policy stops the sweep with one line; shards already done are kept.

`PlanSource` runs this on a thread (`background=True`, started once Ray is up, so planning overlaps the
actors' imports and engine start) or at once; `preflight` collects it for `raysweep plan` and tests.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from cluster.contracts.checkpoint import family
from cluster.contracts.errors import PreflightError
from cluster.contracts.spec import ModelSpec, SweepSpec
from cluster.contracts.structured import xgrammar_message
from cluster.contracts.task_spec import no_room
from cluster.inputs.builtin_model import resolve_model_path
from cluster.inputs.checks import check_inputs
from cluster.inputs.data import TaskData
from cluster.inputs.grammar_cache import CompiledBefore
from cluster.inputs.staging import StagingFolder
from cluster.inputs.token_cache import TokenCache
from cluster.plan.planner import TaskPlan, plan_replay, plan_task


@dataclass
class ModelReady:
    """A model passed every check: its actors may start."""
    model: ModelSpec
    path: str  # resolved local path (builtin models built)
    family: str | None = None  # equal for checkpoints of one model (cluster/contracts/checkpoint.py)


@dataclass
class ModelPlan:
    model: ModelSpec
    path: str
    tasks: list[TaskPlan]


def compile_for(model: ModelSpec, tokenizer, spec: SweepSpec) -> None:
    """Compile each structured spec once against this model's tokenizer, as the engines will; a spec that compiled
    against these tokenizer files before is not compiled again (cluster/inputs/grammar_cache.py)."""
    structured = [t for t in spec.tasks if t.structured is not None]
    if not structured:  # no fingerprint taken: of a loaded hub tokenizer, that serialises its whole definition
        return
    compiled = CompiledBefore(tokenizer)
    structured = [t for t in structured if t.structured not in compiled]
    if not structured:
        return
    import xgrammar as xgr

    from cluster.contracts.structured import to_grammar

    from cluster.inputs.model_files import unwrapped

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(unwrapped(tokenizer)), max_threads=1)
    for task in structured:
        try:
            compiler.compile_grammar(to_grammar(task.structured))
        except Exception as e:  # xgrammar's own error types; the message is what matters
            raise PreflightError(f"{spec.source}: tasks.{task.name}.structured: does not compile for model "
                                   f"{model.name}: {xgrammar_message(e)}") from None
        compiled.add(task.structured)


def one_line(e: BaseException, limit: int = 400) -> str:
    """An error's message as one line: transformers breaks a sentence over lines ("Couldn't instantiate the
    backend tokenizer from one of: \n(1) ..."), so the non-blank lines are joined, and a long one cut."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def load_model_meta(model: ModelSpec, path: str, source: str = "<spec>"):
    """The model's resolved path, its tokenizer and the length its files give (engine.max_model_len aside).
    A tokenizer known by its files that counted prompts into the token cache before (so it loaded then) is
    loaded only if planning needs it: a sweep whose prompts were all measured before loads none
    (cluster/inputs/model_files.py)."""
    from cluster.inputs.model_files import LazyTokenizer, context_length, files_fingerprint, load_tokenizer
    from cluster.inputs.token_cache import measured_before

    def cannot_load(e: BaseException) -> PreflightError:  # OSError, ValueError, hub errors: all mean this
        return PreflightError(f"{source}: model {model.name}: cannot load {model.path!r}: {one_line(e)}")

    try:
        path = resolve_model_path(path)
        known = files_fingerprint(path) if os.path.isdir(path) else None
        if known is not None and measured_before(known):
            tokenizer = LazyTokenizer(path, known, on_error=cannot_load)
        else:
            tokenizer = load_tokenizer(path)
            tokenizer = LazyTokenizer(path, known, loaded=tokenizer) if known is not None else tokenizer
        length = context_length(path)
    except Exception as e:
        raise cannot_load(e) from None
    return path, tokenizer, length


@dataclass(frozen=True)
class LoadedModel:
    """What planning needs of a model that passed every check: its resolved path, tokenizer and length."""
    model: ModelSpec
    path: str
    tokenizer: Any
    max_len: int | None


def load_models(spec: SweepSpec) -> list[LoadedModel]:
    """The expensive checks, once per model folder: its tokenizer and length loaded, every structured spec
    compiled against that tokenizer. Models of one folder (one model under several engine settings, or a
    sweep of thousands of names) share the load and the compile."""
    loaded: dict[str, tuple] = {}
    models = []
    for model in spec.models:
        where = spec.model_path(model)
        if where not in loaded:
            loaded[where] = load_model_meta(model, where, spec.source)
            compile_for(model, loaded[where][1], spec)
        path, tokenizer, length = loaded[where]
        max_len = model.engine.get("max_model_len") or length
        for task in spec.tasks:  # a length known only now (a hub id's, a tokenizer's): checked here, once
            if task.replay is None and max_len is not None and task.sampling.max_tokens >= max_len:
                raise PreflightError(f"{spec.source}: {no_room(model, task, max_len)}")
        models.append(LoadedModel(model, path, tokenizer, max_len))
    return models


def plan_events(spec: SweepSpec, data: list[TaskData], strict: bool = True) -> Iterator[ModelReady | TaskPlan]:
    """For the task data `check_inputs` returned: ModelReady for every model, then each TaskPlan as it is
    made. `strict=False` (for `raysweep plan`) counts prompts over the length limit instead of refusing them."""
    staging = StagingFolder()  # rendered prompts on local disk until their shards are dispatched
    for d in data:  # completions read from the data: no model, no tokenizer
        if d.task.replay is not None:
            plan = plan_replay(d, spec.shards, staging)
            d.check_unchanged()  # what was planned is what was checked
            yield plan
    models = load_models(spec)
    yield from (ModelReady(m.model, m.path, family(m.model, m.path)) for m in models)
    caches: dict[int, TokenCache] = {}  # one per tokenizer loaded: models that share it read its counts once
    for m in models:
        if id(m.tokenizer) not in caches:
            caches[id(m.tokenizer)] = TokenCache(m.tokenizer)
        cache = caches[id(m.tokenizer)]
        for d in (d for d in data if d.task.replay is None):
            plan = plan_task(m.model, d, m.tokenizer, m.max_len, spec.shards, cache, strict, staging)
            d.check_unchanged()  # what was planned is what was checked (and what the manifest's hash says)
            yield plan


def planned_pairs(spec: SweepSpec) -> set[tuple[str, str]]:
    """The (model, task) names of the plans `plan_events` makes: every task for every model, a replay task once,
    under its replay.model."""
    replayed = {(t.replay.model, t.name) for t in spec.tasks if t.replay is not None}
    return replayed | {(m.name, t.name) for m in spec.models for t in spec.tasks if t.replay is None}


def pair_count(spec: SweepSpec) -> int:
    """How many (model, task) plans `plan_events` makes."""
    return len(planned_pairs(spec))


def preflight(spec: SweepSpec, strict: bool = True, data: list[TaskData] | None = None,
              planned: Callable[[int], None] | None = None) -> list[ModelPlan]:
    """Every check (those of `check_inputs` unless their `data` is given) and every plan, at once (a replay
    task's plan under its replay.model, with no path); `planned(n)` after each (model, task) plan, with the
    number made so far."""
    plans: dict[str, ModelPlan] = {}
    made = 0
    for event in plan_events(spec, check_inputs(spec).data if data is None else data, strict):
        if isinstance(event, ModelReady):
            plans[event.model.name] = ModelPlan(event.model, event.path, [])
            continue
        plans.setdefault(event.model.name, ModelPlan(event.model, "", [])).tasks.append(event)
        made += 1
        if planned is not None:
            planned(made)
    return list(plans.values())


class PlanSource:
    """`plan_events` for the scheduler: on a thread (`background=True`), or all made at once, so that
    an error surfaces here, before any Ray call. `take` hands out what is ready and re-raises the
    planner's own error (its type kept: jobs/sweep.py prints expected errors as one line)."""

    _DONE = object()

    def __init__(self, spec: SweepSpec, data: list[TaskData], background: bool = False):
        self._queue: queue.Queue = queue.Queue()
        self.done = False
        self.finished_at: float | None = None  # when planning ended (time.time())
        self._thread = None
        if background:  # started by `start()`: once Ray is up (cluster/schedule/run.py execute)
            self._thread = threading.Thread(target=self._produce, args=(spec, data), name="raysweep-planner",
                                            daemon=True)
        else:
            self._produce(spec, data)
            self._error = next((e for e in list(self._queue.queue) if isinstance(e, BaseException)), None)
            if self._error is not None:
                raise self._error

    def start(self) -> None:
        """Start planning on its thread (`background=True`; else everything was made at construction). Not
        while Ray starts: the actors, which start once Ray is up, are the critical path, and they need their
        plans only once their engines are up (seconds on CPU, tens of seconds on a GPU)."""
        if self._thread is not None and self._thread.ident is None:  # not started yet
            self._thread.start()

    def _produce(self, spec: SweepSpec, data: list[TaskData]) -> None:
        try:
            for event in plan_events(spec, data):
                self._queue.put(event)
        except BaseException as e:  # handed to the driver's thread, which handles it at its edge
            self._queue.put(e)
        finally:
            self.finished_at = time.time()
            self._queue.put(self._DONE)

    def take(self, timeout_s: float) -> list[ModelReady | TaskPlan]:
        """What is ready now (waiting up to timeout_s for the first item); sets `done` at the end."""
        events = []
        block = timeout_s > 0
        while not self.done:
            try:
                event = self._queue.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                break
            block = False
            if event is self._DONE:
                self.done = True
            elif isinstance(event, BaseException):
                raise event
            else:
                events.append(event)
        return events
