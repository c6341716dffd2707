"""FakeEngine: a fake behind the real Engine interface that answers every request at once.

It exists to measure what raysweep itself costs — planning, scheduling, Ray transfers, scoring, Parquet
commits — with no model in the way (`engine: fake` in a spec; `python -m benchmarks --parts o`).
Its output is the constant "fake" and one token per sample; nothing it returns is a measurement of a model.
Like vLLM it holds one profile and is restarted for another, so profile routing can be tested on CPU.
`engine: {backend: fake, delay_s: S}` makes each batch take S seconds, so a test can hold shards in flight
(which actor runs what then does not hang on how fast a second actor's process starts). `hold_file: PATH` makes
each batch wait while PATH exists, so a test holds the work at a moment of its choosing instead of making every
shard slow enough for the slowest machine (two sweeps' shards queued at one pool replica before it runs any).
`start_s: S` makes its start take S seconds (a start that hangs), `fail_start: MESSAGE` makes it raise
RuntimeError(MESSAGE) as it starts: the scheduler's handling of engines that cannot start, tested on CPU.
"""

from __future__ import annotations

from typing import Sequence

# with the module, which an actor imports ahead (actors/engine_factory.py preload): the second of CPU this costs (torch,
# most of transformers) is spent before any start is asked for, not inside the start the scheduler times
from transformers import AutoTokenizer

from actors.engine import (EngineProfile, GenRequest, GenResult, LoglikRequest, LoglikResult, check_loglik_requests,
                           check_requests)
from cluster.contracts.spec import ModelSpec, SamplingSpec, StructuredSpec


class FakeEngine:
    kind = "fake"

    def __init__(self, model: ModelSpec, model_path: str, profile: EngineProfile):
        import time

        started = time.perf_counter()
        time.sleep(float(model.engine.get("start_s", 0)))
        if model.engine.get("fail_start"):
            raise RuntimeError(str(model.engine["fail_start"]))
        self.profile = profile
        self.delay_s = float(model.engine.get("delay_s", 0))
        self.hold_file = model.engine.get("hold_file")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)  # the actor tokenizes shards with it
        self._init_s = time.perf_counter() - started

    def startup(self) -> dict:
        return {"engine_init_s": self._init_s, "warmup_s": None, "load_s": None, "compile_s": None,
                "graph_capture_s": None, "cuda_graphs": False,
                "graph_mode": None, "fallback_reason": None, "chunked_prefill": False,
                "max_num_batched_tokens": None, "max_num_seqs": None}

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 structured: StructuredSpec | None) -> list[GenResult]:
        check_requests(requests)
        self._wait()
        return [GenResult(r.sample_id, "fake", 1, "stop", None, None) for r in requests]

    def loglikelihood(self, requests: Sequence[LoglikRequest]) -> list[LoglikResult]:
        """-1 per token: no model's figure."""
        check_loglik_requests(requests)
        self._wait()
        return [LoglikResult(r.sample_id, [-float(len(c)) for c in r.continuations], [False] * len(r.continuations),
                             None) for r in requests]

    def _wait(self) -> None:
        import os
        import time

        while self.hold_file and os.path.exists(self.hold_file):
            time.sleep(0.05)
        if self.delay_s:
            time.sleep(self.delay_s)

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass
