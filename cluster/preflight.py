"""Preflight and planning (DESIGN §3), as a stream the scheduler consumes while it runs.

1. Checks that need no tokenization, for the whole sweep: every task's data file and columns, every
   structured spec; every model loads (config, tokenizer) and compiles every structured spec.
   A problem here is one line naming the file, task, model or field, before any actor starts.
2. Then one `ModelReady` per model: from here its actors may start.
3. Then one `TaskPlan` per model x task, as each is planned (prompts measured in tokens, the length
   policy applied, shards cut): the scheduler dispatches a task's shards as soon as its plan arrives.
   A prompt refused by the length policy stops the sweep with one line; shards already done are kept.

`PlanSource` runs this on a thread (`background=True`, so planning overlaps Ray's start and the actors'
engine start) or at once; `preflight` collects it for `raysweep plan` and tests.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from cluster.builtin_model import resolve_model_path
from cluster.data import load_task
from cluster.planner import TaskPlan, plan_task
from cluster.spec import ModelSpec, SweepSpec
from cluster.staging import StagingFolder
from cluster.structured import check as check_structured
from cluster.token_cache import TokenCache


class PreflightFailure(ValueError):
    """Raised before any actor starts; the message names the model, task, file or field."""


@dataclass
class ModelReady:
    """A model passed every check: its actors may start."""
    model: ModelSpec
    path: str  # resolved local path (builtin models built)


@dataclass
class ModelPlan:
    model: ModelSpec
    path: str
    tasks: list[TaskPlan]


def plan_events(spec: SweepSpec, strict: bool = True) -> Iterator[ModelReady | TaskPlan]:
    """Checks first (all of them), then ModelReady for every model, then each TaskPlan as it is made.
    `strict=False` (for `raysweep plan`) counts prompts over the length limit instead of refusing them."""
    data = []
    for task in spec.tasks:
        if task.structured is not None:
            try:
                check_structured(task.structured)
            except ValueError as e:
                raise PreflightFailure(f"{spec.source}: tasks.{task.name}.structured.{e}") from None
        data.append(load_task(spec, task))
    models = []
    for model in spec.models:
        path, tokenizer, max_len = _load_model_meta(model)
        _compile_for(model, tokenizer, spec)
        models.append((ModelReady(model, path), tokenizer, max_len))
    yield from (ready for ready, _, _ in models)
    staging = StagingFolder()  # rendered prompts on local disk until their shards are dispatched
    for ready, tokenizer, max_len in models:
        cache = TokenCache(tokenizer)
        for d in data:
            yield plan_task(ready.model, d, tokenizer, max_len, spec.shards, cache, strict, staging)


def preflight(spec: SweepSpec, strict: bool = True) -> list[ModelPlan]:
    """Every check and every plan, at once."""
    plans: dict[str, ModelPlan] = {}
    for event in plan_events(spec, strict):
        if isinstance(event, ModelReady):
            plans[event.model.name] = ModelPlan(event.model, event.path, [])
        else:
            plans[event.model.name].tasks.append(event)
    return list(plans.values())


class PlanSource:
    """`plan_events` for the scheduler: on a thread (`background=True`), or all made at once, so that
    an error surfaces here, before any Ray call. `take` hands out what is ready and re-raises the
    planner's own error (its type kept: jobs/sweep.py prints expected errors as one line)."""

    _DONE = object()

    def __init__(self, spec: SweepSpec, background: bool = False):
        self._queue: queue.Queue = queue.Queue()
        self.done = False
        self.finished_at: float | None = None  # when planning ended (time.time())
        if background:
            threading.Thread(target=self._produce, args=(spec,), name="raysweep-planner", daemon=True).start()
        else:
            self._produce(spec)
            self._error = next((e for e in list(self._queue.queue) if isinstance(e, BaseException)), None)
            if self._error is not None:
                raise self._error

    def _produce(self, spec: SweepSpec) -> None:
        try:
            for event in plan_events(spec):
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


def _compile_for(model: ModelSpec, tokenizer, spec: SweepSpec) -> None:
    """Compile each structured spec once against this model's tokenizer, as the engines will."""
    structured = [t for t in spec.tasks if t.structured is not None]
    if not structured:
        return
    import xgrammar as xgr

    from cluster.structured import to_grammar

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer), max_threads=1)
    for task in structured:
        try:
            compiler.compile_grammar(to_grammar(task.structured))
        except Exception as e:  # xgrammar's own error types; the message is what matters
            raise PreflightFailure(f"task {task.name}: structured output does not compile for model "
                                   f"{model.name}: {str(e).strip().splitlines()[-1]}") from None


def _load_model_meta(model: ModelSpec):
    from transformers import AutoConfig, AutoTokenizer

    try:
        path = resolve_model_path(model.path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # OSError, ValueError, hub errors: all mean "this model cannot be loaded"
        raise PreflightFailure(f"model {model.name}: cannot load {model.path!r}: {str(e).splitlines()[0]}") from None
    max_len = model.engine.get("max_model_len") or getattr(config, "max_position_embeddings", None)
    return path, tokenizer, max_len
