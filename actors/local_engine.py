"""Engines in this process, behind the same calls as engines in an engine process (actors/hosted_engine.py).

An actor runs its engines in one of two places: here (`InProcess`) or in an engine process forked from the
run's engine host (`hosted_engine.EngineProcess`). Both start engines with `start_engine(**make_engine's
arguments)`, both hand back an engine that runs a shard's rows with `run_rows` (the rows are encoded with the
engine's tokenizer where the engine is) and answers `startup`, `sleep`, `wake_up` and `close`, and both let go
of a list of engines with `close`. The actor never asks which it has; `where` names it for telemetry.
The engine process runs its engines through `InProcess` too.
"""

from __future__ import annotations

import time

from actors.engine import Engine
from cluster.contracts.timing import utc


class LocalEngine:
    """An engine of this process and the tokenizer its shards are encoded with."""

    where = "actor"  # the telemetry's engine_process: an engine of the actor's own process

    def __init__(self, engine: Engine, tokenizer, built_at: float | None = None):
        self.engine, self.tokenizer, self.built_at = engine, tokenizer, built_at
        self.kind, self.profile = engine.kind, engine.profile
        counters = getattr(engine, "batch_counters", None)  # vLLM only: how full the engine's batch was
        if callable(counters):
            self.batch_counters = counters

    def run_rows(self, rows: list[dict], task, add_special_tokens: bool):
        from actors.shard_work import run_rows

        return run_rows(self.engine, rows, task, self.tokenizer, add_special_tokens)

    def startup(self) -> dict:
        return {**self.engine.startup(), "built_at": utc(self.built_at)}

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def swap_weights(self, model_path: str) -> dict:
        return self.engine.swap_weights(model_path)

    def close(self) -> None:
        self.engine.close()


class InProcess:
    """Engines started in this process, with the engines' imports done once, ahead (`preload`)."""

    where = "actor"

    def __init__(self, backends=None):
        if backends is not None:
            from actors.engine_factory import preload

            preload(backends)

    def start_engine(self, **kwargs) -> LocalEngine:
        from actors.engine_factory import engine_tokenizer, make_engine

        engine = make_engine(**kwargs)
        return LocalEngine(engine, engine_tokenizer(engine, kwargs["model_path"]), time.time())

    def close(self, engines: list) -> None:
        """Each engine shut down (vLLM's engine-core process with it)."""
        for engine in engines:
            engine.close()
