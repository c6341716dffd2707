"""What `raysweep plan` says on stderr while it plans: nothing for a plan done within FIRST_S, then how many
(model, task) pairs are planned, every EVERY_S, from a thread of its own (the first pair may take long: a
tokenizer that loads, a large data file)."""

from __future__ import annotations

import sys
import threading
import time

from cluster.contracts.spec import SweepSpec
from cluster.plan.plan_source import pair_count

FIRST_S = 2.0
EVERY_S = 2.0


class PlanTicker:
    def __init__(self, spec: SweepSpec, stream=None):
        self.pairs, self.models, self.tasks = pair_count(spec), len(spec.models), len(spec.tasks)
        self.stream = stream or sys.stderr
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="raysweep-plan-ticker", daemon=True)

    def planned(self, n: int) -> None:
        self.done = n

    def __enter__(self) -> PlanTicker:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _tick(self) -> None:
        if self._stop.wait(FIRST_S):
            return
        print(f"[raysweep] planning {self.pairs:,} (model, task) pair(s) of {self.models:,} model(s) and "
              f"{self.tasks:,} task(s)", file=self.stream, flush=True)
        while True:
            print(f"[raysweep] planned {self.done:,}/{self.pairs:,} pairs "
                  f"({time.perf_counter() - self._started:.0f}s)", file=self.stream, flush=True)
            if self._stop.wait(EVERY_S):
                return
