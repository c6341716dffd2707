"""HFEngine: transformers generation on CPU, batched with left padding, xgrammar token masks.

The decode loop is our own (not `model.generate`) so that each row gets its own seed, its own grammar
matcher, stop strings and measured first-token and finish times:
1. left-pad the batch's prompt ids, positions from the attention mask;
2. per step: forward with the KV cache, mask each structured row's logits with its matcher's bitmask,
   pick tokens (greedy, or sampled with the row's own torch.Generator), advance the matchers;
3. a row ends at EOS (the grammar's end included), a stop string, or max_tokens.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from actors.engine import (EngineProfile, GenRequest, GenResult, LoglikRequest, LoglikResult, check_loglik_requests,
                           check_requests)
from cluster.contracts.spec import ModelSpec, SamplingSpec, StructuredSpec

DEFAULT_BATCH = 32


class HFEngine:
    kind = "hf"

    def __init__(self, model: ModelSpec, model_path: str, profile: EngineProfile, num_threads: int | None = None,
                 one_row_at_a_time: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a per-tensor loading bar per actor floods the driver's log
        if num_threads:
            torch.set_num_threads(max(1, int(num_threads)))  # one actor per CPU slot: don't oversubscribe
        started = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self._init_s = time.perf_counter() - started
        self.profile = profile
        # vLLM's name for the same limit; one row at a time (no padding, no neighbours) for `reproducible: true`:
        # measured on builtin:tiny in fp32, batches of 32, 7 and 1 gave the same greedy outputs for 150 rows,
        # but nothing in torch promises that a row's numbers do not depend on its batch
        self.batch_size = 1 if one_row_at_a_time else int(model.engine.get("max_num_seqs", DEFAULT_BATCH))
        self.vocab_size = self.model.config.vocab_size
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id} - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self._compiler = None
        self._stop_lengths: dict[str, int] = {}  # a stop string's lookback in tokens, as lm-eval's hf model takes it
        self._grammars: dict[str, object] = {}
        self._lock = threading.Lock()  # the actor may call generate from two threads; torch runs one batch at a time
        started = time.perf_counter()
        # one short request first: torch's first forward allocates and picks kernels; measured as warmup_s
        self._generate_batch([GenRequest("warm-up", [1, 2, 3, 4], 0)], SamplingSpec(max_tokens=1), None, started)
        self._warmup_s = time.perf_counter() - started

    def startup(self) -> dict:
        return {"engine_init_s": self._init_s, "warmup_s": self._warmup_s,
                "load_s": self._init_s + self._warmup_s, "compile_s": None, "graph_capture_s": None,
                "cuda_graphs": False,
                "graph_mode": None, "fallback_reason": None, "chunked_prefill": False,
                "max_num_batched_tokens": None, "max_num_seqs": self.batch_size}

    def sleep(self) -> None:
        """Nothing moves: the weights stay in this process's memory, so waking costs no reload. The honest
        CPU equivalent of vLLM's sleep mode (there is no accelerator memory to give back)."""

    def wake_up(self) -> None:
        """See sleep."""

    def swap_weights(self, model_path: str) -> dict:
        """The checkpoint at `model_path` read as the engine's own was, and its tensors copied into the model's."""
        import torch
        from transformers import AutoModelForCausalLM

        started = time.perf_counter()
        loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        with self._lock, torch.no_grad():
            self.model.load_state_dict(loaded.state_dict())
        return {"weights_s": time.perf_counter() - started}

    def close(self) -> None:
        self.model = None

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 structured: StructuredSpec | None) -> list[GenResult]:
        check_requests(requests)
        submitted = time.perf_counter()
        results: list[GenResult] = []
        with self._lock:
            grammar = self._grammar(structured) if structured else None
            for start in range(0, len(requests), self.batch_size):
                batch = requests[start:start + self.batch_size]
                results.extend(self._generate_batch(batch, sampling, grammar, submitted))
        return results

    def loglikelihood(self, requests: Sequence[LoglikRequest]) -> list[LoglikResult]:
        """Each choice scored as lm-eval's HF model scores it: the model reads (context + continuation) less its
        last token, which is only predicted; a choice's tokens are read from the log-softmax (fp32) at the
        positions before them. Longest first in batches, right-padded; one row at a time (`reproducible: true`)
        it is lm-eval's batch-1 call itself: no padding, no attention mask, the log-softmax of the whole output,
        so the sums are bit-equal to `lm_eval --model hf --batch_size 1` in float32."""
        import torch

        check_loglik_requests(requests)
        submitted = time.perf_counter()
        seqs = [(i, j, (r.context_ids + cont)[:-1], cont) for i, r in enumerate(requests)
                for j, cont in enumerate(r.continuations)]
        sums = [[0.0] * len(r.continuations) for r in requests]
        greedy = [[False] * len(r.continuations) for r in requests]
        order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k][2]))
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = [seqs[k] for k in order[start:start + self.batch_size]]
                for (i, j, _, _), (total, matched) in zip(batch, self._scores(batch)):
                    sums[i][j], greedy[i][j] = total, matched
        latency = time.perf_counter() - submitted
        return [LoglikResult(r.sample_id, sums[i], greedy[i], latency) for i, r in enumerate(requests)]

    def _scores(self, batch: list[tuple[int, int, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, greedy) of each (_, _, input ids, continuation) of one batch."""
        import torch

        if len(batch) == 1:  # lm-eval's HFLM._loglikelihood_tokens at batch size 1, step for step
            _, _, seq, cont = batch[0]
            logprobs = torch.log_softmax(self.model(torch.tensor([seq])).logits, dim=-1)
            selected = logprobs[0, len(seq) - len(cont):len(seq)].unsqueeze(0)
            wanted = torch.tensor(cont).unsqueeze(0)
            matched = bool((selected.argmax(dim=-1) == wanted).all())
            return [(float(torch.gather(selected, 2, wanted.unsqueeze(-1)).squeeze(-1).sum()), matched)]
        width = max(len(seq) for _, _, seq, _ in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (_, _, seq, _) in enumerate(batch):
            ids[b, :len(seq)], mask[b, :len(seq)] = torch.tensor(seq), 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        out = []
        for b, (_, _, seq, cont) in enumerate(batch):
            logprobs = torch.log_softmax(logits[b, len(seq) - len(cont):len(seq)].float(), dim=-1)
            wanted = torch.tensor(cont)
            out.append((float(logprobs.gather(1, wanted[:, None]).sum()), bool((logprobs.argmax(-1) == wanted).all())))
        return out

    def _grammar(self, spec: StructuredSpec):
        """Compiled once per spec for this engine's tokenizer."""
        import xgrammar as xgr

        from cluster.contracts.structured import to_grammar

        key = spec.key()
        if key not in self._grammars:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=sorted(self.eos_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._grammars[key] = self._compiler.compile_grammar(to_grammar(spec))
        return self._grammars[key]

    def _generate_batch(self, reqs: Sequence[GenRequest], sampling: SamplingSpec, grammar, submitted: float):
        import torch
        import xgrammar as xgr

        n, width = len(reqs), max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(reqs):
            if r.prompt_token_ids:
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        matchers = [xgr.GrammarMatcher(grammar) for _ in reqs] if grammar is not None else None
        bitmask = xgr.allocate_token_bitmask(n, self.vocab_size) if grammar is not None else None
        generators = [torch.Generator().manual_seed(r.seed) for r in reqs] if sampling.temperature > 0 else None
        rows = [_Row() for _ in reqs]
        past = None
        with torch.inference_mode():
            for _ in range(sampling.max_tokens):
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
                active = [i for i, row in enumerate(rows) if row.finish is None]
                if matchers is not None:
                    for i in active:
                        matchers[i].fill_next_token_bitmask(bitmask, i)
                    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=active)
                picked = _pick(logits, sampling, generators)
                now = time.perf_counter()
                for i in active:
                    self._advance(rows[i], picked[i], matchers[i] if matchers else None, sampling, now)
                if all(row.finish is not None for row in rows):
                    break
                ids = torch.tensor([[t if row.finish is None else self.pad_id] for t, row in zip(picked, rows)])
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
        return [self._result(r, row, submitted) for r, row in zip(reqs, rows)]

    def _advance(self, row: "_Row", token: int, matcher, sampling: SamplingSpec, now: float) -> None:
        row.first_at = row.first_at or now
        row.n_generated += 1
        if matcher is not None and not matcher.accept_token(token):
            raise RuntimeError(f"grammar rejected token {token} that its own mask allowed")
        if token in self.eos_ids:
            row.finish = "stop"
        else:
            row.tokens.append(token)
            if sampling.stop:
                text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
                cut = min((i for i in (text.find(s) for s in sampling.stop) if i >= 0), default=-1)
                if cut >= 0:
                    row.text, row.finish = text[:cut], "stop"
                elif self._stop_in_lookback(row.tokens, sampling.stop):
                    row.text, row.finish = text, "stop"
            if row.finish is None and row.n_generated >= sampling.max_tokens:
                row.finish = "length"
        if row.finish is not None:
            row.finished_at = now

    def _stop_in_lookback(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        """lm-eval's `--model hf` stops where a stop string is in the last (its tokens + 2) generated tokens
        decoded with their special tokens (lm_eval/models/utils_hf.py, MultiTokenEOSCriteria): a special token
        whose text holds the string (`<|reserved_1|>` for `until: ["e"]`) ends the row, whose text, decoded
        without special tokens, then holds no stop string to cut at."""
        for stop in stops:
            n = self._stop_lengths.get(stop)
            if n is None:
                n = self._stop_lengths[stop] = len(self.tokenizer.encode(stop, add_special_tokens=False)) + 2
            if stop in self.tokenizer.decode(tokens[-n:]):
                return True
        return False

    def _result(self, req: GenRequest, row: "_Row", submitted: float) -> GenResult:
        text = row.text if row.text is not None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return GenResult(sample_id=req.sample_id, output_text=text, output_tokens=row.n_generated,
                         finish_reason=row.finish or "length",
                         latency_s=row.finished_at - submitted if row.finished_at else None,
                         ttft_s=row.first_at - submitted if row.first_at else None)


class _Row:
    """Decode state of one request."""
    __slots__ = ("tokens", "n_generated", "finish", "text", "first_at", "finished_at")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.n_generated = 0
        self.finish: str | None = None
        self.text: str | None = None  # set when a stop string cut the output
        self.first_at: float | None = None
        self.finished_at: float | None = None


# vLLM's SamplingParams raises a temperature between 0 and this to it (logits divided by less overflow to inf)
MIN_TEMPERATURE = 0.01


def _pick(logits, sampling: SamplingSpec, generators) -> list[int]:
    """Greedy argmax, or temperature / top-k / top-p sampling with each row's own generator; a temperature above 0
    but under MIN_TEMPERATURE samples at MIN_TEMPERATURE, as vLLM does."""
    import torch

    if sampling.temperature == 0:
        return logits.argmax(dim=-1).tolist()
    logits = logits / max(sampling.temperature, MIN_TEMPERATURE)
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > sampling.top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return [int(torch.multinomial(probs[i], 1, generator=g)) for i, g in enumerate(generators)]
