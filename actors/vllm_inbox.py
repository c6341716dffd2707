"""What callers hand the vLLM engine's thread (actors/vllm_engine.py): batches of requests and calls to run
between steps, through one inbox. The engine thread is vLLM's only user; every other thread waits on the work it
handed in. Where the engine thread fails and the process goes on (`VllmEngine(exit_on_error=False)`), the inbox
fails what is running and queued with the engine's error, and refuses what comes after."""

from __future__ import annotations

import queue
import threading
from typing import Sequence

from actors.engine import GenRequest, GenResult


class Call:
    """Work for the engine thread other than requests (sleep, wake up): run between steps."""

    def __init__(self, call):
        self.call, self.error, self.done = call, None, threading.Event()

    def run(self) -> None:
        try:
            self.call()
        except Exception as e:  # raised in the caller's thread
            self.error = e
        finally:
            self.done.set()


class Batch:
    """One generate() or loglikelihood() call: its requests, and the results the engine thread fills in."""

    def __init__(self, requests: Sequence[GenRequest], params: list, convert=None):
        self.requests, self.params = list(requests), params
        self.convert = convert or result_of  # (request, vLLM's RequestOutput) -> what the caller gets
        self.results: list[GenResult | None] = [None] * len(self.requests)
        self.remaining = len(self.requests)
        self.done = threading.Event()
        self.error: BaseException | None = None  # the engine thread failed before every result was in

    def finish(self, i: int, result: GenResult) -> None:
        self.results[i] = result
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()


def result_of(req: GenRequest, out) -> GenResult:
    """A generation request's result from vLLM's RequestOutput."""
    completion = out.outputs[0]
    m = out.metrics  # vLLM's RequestStateStats: TTFT from the frontend, decode span from the engine core
    ttft = m.first_token_latency if m is not None and m.first_token_latency > 0 else None
    latency = ttft + max(0.0, m.last_token_ts - m.first_token_ts) if ttft is not None else None
    return GenResult(sample_id=req.sample_id, output_text=completion.text, output_tokens=len(completion.token_ids),
                     finish_reason=completion.finish_reason or "length", latency_s=latency, ttft_s=ttft)


class Inbox:
    """Batches and calls for the engine thread, in the order handed in; None tells it to stop."""

    def __init__(self):
        self.broken: BaseException | None = None  # the engine thread's error, once it ended on one
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # a failing engine thread takes what is queued under the same lock

    def submit(self, work: Batch | Call) -> Batch | Call:
        """Hand `work` to the engine thread and wait for it; the engine's error where it failed."""
        with self._lock:
            if self.broken is not None:
                raise RuntimeError(f"the vLLM engine failed earlier: {self.broken!r}") from self.broken
            self._queue.put(work)
        work.done.wait()
        if isinstance(work, Batch) and work.error is not None:
            raise RuntimeError(f"the vLLM engine failed: {work.error!r}") from work.error
        return work

    def get(self, block: bool) -> Batch | Call | None:
        """The next work (None: stop); queue.Empty where none waits and `block` is False."""
        return self._queue.get(block=block)

    def stop(self) -> None:
        self._queue.put(None)

    def fail_all(self, error: BaseException, running: list) -> None:
        """The engine thread ended on `error`: the batches it ran (`running`) and everything queued fail with it,
        and every later `submit` raises it."""
        with self._lock:
            self.broken = error
            while True:
                try:
                    running.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for work in running:
            if work is not None:
                work.error = work.error or error
                work.done.set()
