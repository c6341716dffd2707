"""VllmEngine: vLLM 0.26 on one GPU, behind the same interface as the CPU engine.

- CUDA graphs: `enforce_eager=False`, captured up to the batch limit (`max_num_seqs`, actors/vllm_args.py).
  The graph mode actually captured (vLLM may downgrade FULL to PIECEWISE for an attention backend) and the
  seconds of the start's steps (weights, torch.compile, memory profile, capture, the engine core's whole init)
  are read from vLLM's own start-up report; if the engine cannot start with graphs it starts eager and
  `fallback_reason` says why.
- Profiles (docs/design.md, Planning): `short` turns chunked prefill off (vLLM then sets max_num_batched_tokens =
  max_model_len, so no prompt is ever split); `long` turns it on with the chunk size from the plan.
- Structured outputs: vLLM's `StructuredOutputsParams`, xgrammar backend forced, compact JSON.
- Warm-up: a few short requests run before the engine is reported started (included in load_s).
- Engine core: a process forked from the actor's forkserver by default (actors/vllm_core_process.py says
  why and what else `RAYSWEEP_VLLM_CORE` offers); in the actor's own process (`inprocess`) the engine
  frees its GPU memory itself at a profile or model change.
- Streaming: one engine thread owns the `LLM` and steps it; `generate` calls from concurrent shards
  enqueue their requests into the running batch, so the next shard is admitted before the last ends.
  If stepping the engine raises, the actor process exits so the scheduler retries its shards elsewhere
  (`exit_on_error=False`: the calls waiting, and every later one, raise the error instead: actors/vllm_inbox.py).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Sequence

from actors import vllm_core_process
from actors.engine import (EngineProfile, GenRequest, GenResult, LoglikRequest, LoglikResult, check_loglik_requests,
                           check_requests)
from actors.telemetry import gpu_total_bytes
from actors.vllm_inbox import Batch, Call, Inbox
from actors.vllm_prompt_logprobs import PromptTail, prompt_tail
from actors.vllm_registry import inspect_here
from actors.vllm_args import engine_args, sampling_kwargs, shared_kv_bytes
from actors.vllm_start_errors import GRAPH_FAILURE, MEMORY_RACE, error_lines, failure_line, with_root_cause
from cluster.contracts.spec import ModelSpec, SamplingSpec, StructuredSpec

CORE_EXIT_S = 1.0  # an engine core still running this long after it was told to stop is killed
CORE_GONE_S = 30.0  # ... and its exit awaited at most this long

# vLLM 0.26's start-up report, as its engine core logs it at INFO (one line each, the last one counts)
_WEIGHTS = re.compile(r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds")  # v1/worker/*model_runner.py
_COMPILE = re.compile(r"torch\.compile (?:takes|took) ([\d.]+) s in total")  # compilation/monitor.py
_PROFILE = re.compile(r"Initial profiling/warmup run took ([\d.]+) s")  # compilation/monitor.py
_CAPTURE = re.compile(r"Graph capturing finished in ([\d.]+) secs")  # v1/worker/*model_runner.py
_CORE_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")  # v1/engine/core.py
MEMORY_RACE_ATTEMPTS = 4
MEMORY_RACE_WAIT_S = 5.0  # times the attempt number
_MODE = re.compile(r"Capturing CUDA graphs \((?:[^()]*?, )?(FULL|PIECEWISE)\)")


class VllmEngine:
    kind = "vllm"

    def __init__(self, model: ModelSpec, model_path: str, profile: EngineProfile, gpu_fraction: float = 1.0,
                 sleep_mode: bool = False, reproducible: bool = False, exit_on_error: bool = True):
        """`exit_on_error`: where the engine thread fails, the process exits (an actor: Ray reports it dead and
        its shards are retried); False (an engine in a process that must go on, a test's): every call waiting
        or made after raises the engine's error instead."""
        self.exit_on_error = exit_on_error
        vllm_core_process.start()
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"model {model.name}: vLLM is not installed: pip install 'raysweep[vllm]' ({e})") from e
        self.profile = profile
        self.reproducible = reproducible
        self.args = engine_args(model, model_path, profile, gpu_fraction,
                                shared_kv_bytes(model, model_path, gpu_fraction, gpu_total_bytes()), reproducible)
        if sleep_mode:  # a pool replica switching models: weights to CPU memory and back, no restart
            self.args["enable_sleep_mode"] = True
        self._fallback_reason: str | None = None
        self.engine_core = vllm_core_process.use_for_engine_core()  # forkserver, spawned or in-process
        self._tee = vllm_core_process.OutputTee.install()
        mark = self._tee.mark()
        started = time.perf_counter()
        inspect_here(model_path)  # on a node new to vLLM: no new interpreter inside LLM(...) (actors/vllm_registry.py)
        # the start-up report read below (compile and capture times) is logged at INFO by the engine core
        # (forked: the forkserver started at INFO; spawned; or this process): keep that level for it,
        # whatever VLLM_LOGGING_LEVEL says here
        level = os.environ.get("VLLM_LOGGING_LEVEL")
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"  # read by a spawned engine core as it starts
        try:
            with _info_logs():  # an in-process engine core logs through this process's vllm logger
                self.llm = self._start()
        finally:
            vllm_core_process.restore_env("VLLM_LOGGING_LEVEL", level)
        self._init_s = time.perf_counter() - started
        if self.engine_core in ("forkserver", "forked"):
            self.engine_core = vllm_core_process.used_mode() or self.engine_core  # spawned where it did not fit
        self._warm_up()
        self._load_s = time.perf_counter() - started
        self._warmup_s = self._load_s - self._init_s
        self._report = self._tee.text_since(mark)
        self.tokenizer = self.llm.get_tokenizer()
        self._inbox = Inbox()
        self._closing = False
        self.steps, self.batch_sum = 0, 0  # engine steps, and requests the engine held at each (capped at max_num_seqs)
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    def _start(self):
        """`LLM(...)` with CUDA graphs. Where the engine core failed in graph capture or torch.compile, it
        starts eager and `fallback_reason` says why; where GPU memory moved under a neighbour's engine on the
        same GPU (MEMORY_RACE), it waits and tries again, a few times; any other failure is the engine's
        own error, raised as is."""
        from vllm import LLM

        args = dict(self.args)
        eager, attempt = bool(args.pop("enforce_eager", False)), 1  # the spec may ask for eager itself
        while True:
            mark = self._tee.mark()
            try:
                return LLM(**args, enforce_eager=eager)
            except Exception as e:
                # the engine core's log (a forked or spawned one writes its traceback there) and ours
                core_log = self._tee.text_since(mark)
                cause = error_lines(f"{core_log}\n{traceback.format_exc()}")
                if MEMORY_RACE.search(cause) and attempt < MEMORY_RACE_ATTEMPTS:
                    print(f"[raysweep] engine start {attempt} of {MEMORY_RACE_ATTEMPTS}: GPU memory moved under "
                          f"another engine on this GPU ({failure_line(e, core_log)}); starting again", file=sys.stderr)
                    time.sleep(MEMORY_RACE_WAIT_S * attempt)
                    attempt += 1
                    continue
                if eager or not GRAPH_FAILURE.search(cause):
                    raise with_root_cause(e, core_log) from e
                if self.reproducible:  # eager kernels are not batch-invariant: no silent fallback
                    raise RuntimeError(f"reproducible: true needs CUDA graphs and torch.compile, and the engine "
                                       f"could not start with them: {failure_line(e, core_log)}") from e
                self._fallback_reason = failure_line(e, core_log)
                print(f"[raysweep] CUDA graph start failed ({self._fallback_reason}); starting eager", file=sys.stderr)
                eager = True

    def _warm_up(self) -> None:
        """A few short requests through the started engine (part of load_s), so the first shard's TTFT
        and throughput are the engine's, not its first-request costs."""
        from vllm import SamplingParams

        self.llm.generate([{"prompt_token_ids": list(range(1, 17))}] * 8, SamplingParams(max_tokens=8, temperature=1.0),
                          use_tqdm=False)

    def startup(self) -> dict:
        report = start_report(self._report)
        if report["graph_mode"] == "NONE":  # no capture in the report read: its lines not logged (a level above
            # INFO where the core was forked) or not read, or none captured; the mode vLLM resolved says which
            report["graph_mode"] = configured_graph_mode(self.llm.llm_engine.vllm_config.compilation_config)
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        return {"engine_init_s": self._init_s, "warmup_s": self._warmup_s, "load_s": self._load_s, **report,
                "engine_core": self.engine_core,
                "cuda_graphs": report["graph_mode"] != "NONE" and self._fallback_reason is None,
                "fallback_reason": self._fallback_reason,
                "chunked_prefill": bool(sched.enable_chunked_prefill),
                "max_num_batched_tokens": int(sched.max_num_batched_tokens),
                "max_num_seqs": int(sched.max_num_seqs)}

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 structured: StructuredSpec | None) -> list[GenResult]:
        check_requests(requests)
        return self._inbox.submit(Batch(requests, [self._params(r, sampling, structured) for r in requests])).results

    def loglikelihood(self, requests: Sequence[LoglikRequest]) -> list[LoglikResult]:
        """One request per (row, choice): context + choice ids with `prompt_logprobs=0` (each position's own
        token, its raw log-probability and rank; rank 1 = the strict argmax) and one token generated, as
        lm-eval's vLLM backend asks (it asks for the top 1 too, which the rank makes unneeded).

        What is computed once: vLLM 0.26 reads no prefix cache for a request that asks for prompt
        log-probabilities unless the request says otherwise (sampling_params.py: `skip_reading_prefix_cache`
        defaults to `prompt_logprobs is not None`). These requests say `False`: a row's context is computed for
        its first choice and read from the prefix cache by the others, and a few-shot prefix that many rows
        share is read by every row after the first on this engine. vLLM then computes, and returns
        log-probabilities for, only the tokens after the cache hit (docs/gpu.md, Log-likelihood): each
        request keeps its choice's tokens' values where they were computed, and a request whose cache hit
        reached into its choice (the context ends on a block boundary that a sibling filled) runs again
        without reading the cache. With prefix caching off (`reproducible: true`) every token is computed,
        as before. The log-probabilities come back in vLLM's flat container (`flat_logprobs`: a few lists
        per request, not a dict and a Logprob object per prompt token)."""
        check_loglik_requests(requests)
        flat = [(r.context_ids + cont, len(cont)) for r in requests for cont in r.continuations]
        submitted = time.perf_counter()
        tails = self._prompt_tails(flat, read_cache=self.args.get("enable_prefix_caching") is not False)
        short = [k for k, (_, n) in enumerate(flat) if len(tails[k].scores) < n]
        if short:  # the cache covered part of the choice: its tokens' values were never computed
            for k, tail in zip(short, self._prompt_tails([flat[k] for k in short], read_cache=False)):
                tails[k] = PromptTail(tail.scores, tails[k].computed + tail.computed)
        latency = time.perf_counter() - submitted
        results, k = [], 0
        for r in requests:
            mine = tails[k:k + len(r.continuations)]
            scored = [t.scores[len(t.scores) - len(cont):] for t, cont in zip(mine, r.continuations)]
            k += len(r.continuations)
            results.append(LoglikResult(r.sample_id, [sum(lp for lp, _ in s) for s in scored],
                                        [all(rank == 1 for _, rank in s) for s in scored], latency,
                                        computed_tokens=sum(t.computed for t in mine)))
        return results

    def _prompt_tails(self, prompts: list[tuple[list[int], int]], read_cache: bool) -> list[PromptTail]:
        """Each (prompt ids, tokens of its choice) scored: the choice's tokens' values (prompt_tail)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, flat_logprobs=True,
                                skip_reading_prefix_cache=not read_cache)
        need = {f"p{k}": n for k, (_, n) in enumerate(prompts)}
        return self._inbox.submit(Batch([GenRequest(f"p{k}", ids, 0) for k, (ids, _) in enumerate(prompts)],
                                        [params] * len(prompts),
                                        convert=lambda req, out: prompt_tail(req, out, need[req.sample_id]))).results

    def sleep(self) -> None:
        """vLLM's sleep mode, level 1: the weights go to CPU memory, the KV cache is dropped, the GPU memory
        is given back. Called only while no shard is in flight; run by the engine thread, between steps."""
        self._on_engine_thread(lambda: self.llm.sleep(level=1))

    def wake_up(self) -> None:
        self._on_engine_thread(self.llm.wake_up)

    def swap_weights(self, model_path: str) -> dict:
        """Another checkpoint of the same model loaded in place: vLLM's `reload_weights` on every worker, from
        `model_path` (v1/worker/gpu_model_runner.py: its loader reads that folder's weights into the model's own
        tensors, which the captured CUDA graphs and compiled code read), then its prefix cache emptied: the KV
        blocks it holds were computed with the old weights. Run by the engine thread, between steps."""
        started = time.perf_counter()

        def swap() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not empty its prefix cache after the weights were loaded")

        self._on_engine_thread(swap)
        return {"weights_s": time.perf_counter() - started}

    def _on_engine_thread(self, call) -> None:
        work = self._inbox.submit(Call(call))
        if work.error is not None:
            raise work.error

    def close(self) -> None:
        self._closing = True
        self._inbox.stop()
        self._thread.join(timeout=60)
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            # the engine core holds the GPU memory, which a profile or model switch needs back: it is
            # asked to stop, and killed after a second (its own exit took 4 s on an H100: CUDA teardown);
            # vLLM does not wait for a killed process, so its exit is awaited here before the next start
            processes = self._engine_core_processes()
            core.shutdown(timeout=CORE_EXIT_S)
            for process in processes:
                process.join(CORE_GONE_S)
        self.llm = None
        if self.engine_core == "in-process":
            _release_in_process_memory()

    @staticmethod
    def _params(req: GenRequest, sampling: SamplingSpec, structured: StructuredSpec | None):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        kwargs = sampling_kwargs(sampling, req.seed, structured)
        guide = kwargs.pop("structured_outputs")
        return SamplingParams(**kwargs, structured_outputs=StructuredOutputsParams(**guide) if guide else None)

    # -- the engine thread ------------------------------------------------------------------------
    def batch_counters(self) -> tuple[int, int]:
        """(steps, sum over steps of the requests held, capped at max_num_seqs): the mean batch over a
        window is the difference of two readings' sums over the difference of their steps."""
        return self.steps, self.batch_sum

    def _run(self) -> None:
        pending: dict[str, tuple[Batch, int]] = {}
        taken: set[Batch] = set()  # every batch taken from the inbox and not done: none is lost if the engine fails
        engine = self.llm.llm_engine
        cap = int(engine.vllm_config.scheduler_config.max_num_seqs)
        try:
            while not self._closing:
                self._admit(pending, taken, block=not engine.has_unfinished_requests())
                if not engine.has_unfinished_requests():
                    continue
                self.steps += 1
                self.batch_sum += min(engine.get_num_unfinished_requests(), cap)
                for out in engine.step():
                    if out.finished:
                        batch, i = pending.pop(out.request_id)
                        batch.finish(i, batch.convert(batch.requests[i], out))
                        if batch.done.is_set():
                            taken.discard(batch)
        except BaseException as e:  # the engine is broken: exit so Ray reports the actor dead and shards are retried
            traceback.print_exc()
            if not self.exit_on_error:  # what waits, and what comes after, raises `e`
                self._inbox.fail_all(e, [batch for batch in taken if not batch.done.is_set()])
                return
            self._tee.drain()  # the traceback out to the actor's log before the process goes
            self.kill_engine_cores()
            os._exit(1)

    def kill_engine_cores(self) -> None:
        """Kill the engine core processes this engine started, before its process exits without closing it: a
        forked core outlives its parent (on an H200 one held 43.5 GiB of its GPU for minutes after an
        engine thread's error ended its pytest process), and the next engine on that GPU finds too little."""
        for process in self._engine_core_processes():
            try:
                process.kill()
            except Exception:  # noqa: BLE001  (gone already, or not ours to signal: the exit goes on)
                pass

    def _engine_core_processes(self) -> list:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        return list(getattr(getattr(getattr(core, "resources", None), "engine_manager", None), "processes", None)
                    or [])

    def _admit(self, pending: dict, taken: set, block: bool) -> None:
        while True:
            try:
                batch = self._inbox.get(block=block)
            except queue.Empty:
                return
            if batch is None:
                return
            if isinstance(batch, Call):
                batch.run()
                continue
            taken.add(batch)  # before vLLM sees it: an enqueue that raises leaves it to fail_all
            prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in batch.requests]
            ids = self.llm.enqueue(prompts, batch.params, use_tqdm=False)
            for i, request_id in enumerate(ids):
                # enqueue returns vLLM's internal id ("<id>-<8 random chars>"); outputs carry the external
                # "<id>" (the same when VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set)
                pending[request_id.rsplit("-", 1)[0]] = (batch, i)
            if not batch.requests:
                batch.done.set()
                taken.discard(batch)
            block = False


def start_report(text: str) -> dict:
    """The seconds of an engine's start-up steps and the graph mode it captured, as vLLM's start-up report (the
    engine core's INFO lines) gives them; a step the report does not name is None (no torch.compile in an
    uncompiled engine), a mode none ("NONE": eager)."""
    modes = sorted(set(_MODE.findall(text)))
    return {"weights_s": _last_float(_WEIGHTS, text), "core_init_s": _last_float(_CORE_INIT, text),
            "compile_s": _last_float(_COMPILE, text), "profile_run_s": _last_float(_PROFILE, text),
            "graph_capture_s": _last_float(_CAPTURE, text),
            "graph_mode": "_AND_".join(modes) if modes else "NONE"}  # FULL_AND_PIECEWISE, as vLLM names it


def configured_graph_mode(compilation) -> str:
    """The CUDA graphs a started engine captured, by the cudagraph_mode vLLM resolved (NONE for an eager engine), named
    as the start-up report names them: FULL_DECODE_ONLY captures full graphs alone ("FULL")."""
    name = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
    return "FULL" if name == "FULL_DECODE_ONLY" else name


def _last_float(pattern: re.Pattern, text: str) -> float | None:
    found = pattern.findall(text)
    return float(found[-1]) if found else None


@contextmanager
def _info_logs():
    """The `vllm` logger and its handlers at INFO for a while (they were set up at import, from
    VLLM_LOGGING_LEVEL), so the start-up report is written whatever level the user chose."""
    logger = logging.getLogger("vllm")
    saved = [(obj, obj.level) for obj in (logger, *logger.handlers)]
    for obj, _ in saved:
        obj.setLevel(logging.INFO)
    try:
        yield
    finally:
        for obj, level in saved:
            obj.setLevel(level)


def _release_in_process_memory() -> None:
    """With the engine core in this process, its model and KV cache are this process's CUDA memory and
    vLLM's distributed state is this process's: both must go before the next engine starts here."""
    import gc

    import torch

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()
