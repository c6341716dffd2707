"""A shard's rows through an engine, on the actor: requests built, the engine called, results rows made
(columns from cluster/contracts/results_schema.py).

1. Token ids: each row's prompt tokenized here (checked against the length the driver measured), or, for a
   loglikelihood task, its context and choices encoded as the driver planned them (cluster/contracts/loglikelihood.py).
2. A generate task with `sampling.n` > 1 sends n requests per row, completion c with its own seed.
3. The engine is called once for the shard; where that raises and the task tolerates row errors
   (`fail_on_error` not True), the requests run one by one, so only the rows that break are error rows.
4. One results row per completion (per row for loglikelihood, with one value per choice), with the prompt as
   the engine was given it (rendered: chat template, few-shot context).
5. lm-eval's loglikelihood_rolling rows: the document in windows, one request each, summed per row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from actors.engine import GenRequest, LoglikRequest, LoglikResult
from cluster.contracts.shard import EMPTY_PROMPT, NOT_RUN, RowStatus, completion_seed
from cluster.contracts.tokens import tokenize
from cluster.contracts.task_spec import TaskSpec

# Failure injection, for tests only: RAYSWEEP_TEST_FAIL_SAMPLES (sample ids, comma-separated) makes every engine
# call that holds one of those samples raise, as an engine that breaks on a row would
# (tests/test_reliability.py: bisection). Actors inherit it from the driver that started Ray; unset, nothing.
FAIL_SAMPLES_ENV = "RAYSWEEP_TEST_FAIL_SAMPLES"


@dataclass
class ShardOutcome:
    rows: list[dict]  # the actor's results columns, one dict per results row
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    # log-likelihood shards: prompt tokens the engine was asked to score (context + choice, per choice) and those
    # it computed (not read from its prefix cache); None for generation
    prompt_tokens_requested: int | None = None
    prompt_tokens_computed: int | None = None


def run_rows(engine, rows: list[dict], task: TaskSpec, tokenizer, add_special_tokens: bool) -> ShardOutcome:
    runnable = [r for r in rows if r["status"] not in NOT_RUN]  # error: refused in planning
    if task.rolling:
        return _rolling(engine, rows, runnable, task, tokenizer, add_special_tokens)
    if task.loglikelihood:
        return _choices(engine, rows, runnable, task, tokenizer, add_special_tokens)
    return _completions(engine, rows, runnable, task, tokenizer, add_special_tokens)


def _completions(engine, rows, runnable, task: TaskSpec, tokenizer, add_special_tokens: bool) -> ShardOutcome:
    n = task.sampling.n
    _prompt_ids(runnable, tokenizer, add_special_tokens)
    requests = [GenRequest(_key(r["sample_id"], c, n), r["prompt_token_ids"], completion_seed(r["seed"], c))
                for r in runnable for c in range(n)]
    generated, errors = _tolerant(lambda reqs: engine.generate(reqs, task.sampling, task.structured), requests, task)
    out = ShardOutcome([])
    for r in rows:
        for c in range(n):
            key = _key(r["sample_id"], c, n)
            g = generated.get(key)
            error = errors.get(key) or (EMPTY_PROMPT if r["status"] == RowStatus.ERROR else None)
            status = RowStatus.ERROR.value if error else r["status"]
            out.rows.append({"sample_id": r["sample_id"], "completion": c, "status": status,
                             "error": error, "prompt": r["prompt"], "output_text": g.output_text if g else None,
                             "output_tokens": g.output_tokens if g else None,
                             "finish_reason": g.finish_reason if g else None,
                             "latency_s": g.latency_s if g else None, "ttft_s": g.ttft_s if g else None})
    out.output_tokens = sum(g.output_tokens for g in generated.values())
    out.ttfts = [g.ttft_s for g in generated.values() if g.ttft_s is not None]
    return out


def _choices(engine, rows, runnable, task: TaskSpec, tokenizer, add_special_tokens: bool) -> ShardOutcome:
    from cluster.contracts.loglikelihood import continuations, encode_pairs, pair_lengths

    encoded = encode_pairs([r["prompt"] for r in runnable], [continuations(task, r["choices"]) for r in runnable],
                           tokenizer, add_special_tokens)
    requests, cut = [], {}
    for r, length, (ctx, conts) in zip(runnable, pair_lengths(encoded), encoded):
        cap = None if r.get("window") is None else r["window"] + 1
        _same_length(r, length if cap is None else min(length, cap))
        if cap is None or length <= cap:
            requests.append(LoglikRequest(r["sample_id"], ctx, conts))
            continue
        # an lm-eval task's context too long: each choice on the context's last tokens that fit, as lm-eval's
        # models keep (context + choice)[-(max_length + 1):]
        cut[r["sample_id"]] = [f"{r['sample_id']}#c{j}" for j in range(len(conts))]
        requests.extend(LoglikRequest(key, ctx[len(ctx) - max(1, cap - len(c)):], [c])
                        for key, c in zip(cut[r["sample_id"]], conts))
    scored, errors = _tolerant(engine.loglikelihood, requests, task)
    out = ShardOutcome([])
    _count_tokens(out, requests, scored)
    for sample_id, keys in cut.items():  # the cut row's choices, one result again
        if all(k in scored for k in keys):
            parts = [scored.pop(k) for k in keys]
            scored[sample_id] = LoglikResult(sample_id, [p.logprobs[0] for p in parts], [p.greedy[0] for p in parts],
                                             max((p.latency_s or 0.0) for p in parts))
        elif any(k in errors for k in keys):
            errors[sample_id] = next(errors[k] for k in keys if k in errors)
    for r in rows:
        s = scored.get(r["sample_id"])
        error = errors.get(r["sample_id"]) or (EMPTY_PROMPT if r["status"] == RowStatus.ERROR else None)
        status = RowStatus.ERROR.value if error else r["status"]
        out.rows.append({"sample_id": r["sample_id"], "completion": 0, "status": status,
                         "error": error, "prompt": r["prompt"], "latency_s": s.latency_s if s else None,
                         "choice_logprobs": s.logprobs if s else None, "choice_greedy": s.greedy if s else None})
    return out


def _rolling(engine, rows, runnable, task: TaskSpec, tokenizer, add_special_tokens: bool) -> ShardOutcome:
    """lm-eval's loglikelihood_rolling: each row's document tokenized whole, cut into its windows
    (cluster/contracts/loglikelihood.py: rolling_windows), one request per window; the row's one choice is
    scored the sum of its windows, greedy where every window is."""
    from cluster.contracts.loglikelihood import prefix_token, rolling_length, rolling_windows

    requests, windows = [], {}
    for r, ids in zip(runnable, tokenize([r["choices"][0] for r in runnable], tokenizer, add_special_tokens)):
        _same_length(r, rolling_length(len(ids), r["window"]))
        pairs = rolling_windows(ids, prefix_token(tokenizer), r["window"])
        windows[r["sample_id"]] = [f"{r['sample_id']}#w{k}" for k in range(len(pairs))]
        requests.extend(LoglikRequest(key, ctx, [cont]) for key, (ctx, cont) in zip(windows[r["sample_id"]], pairs))
    scored, errors = _tolerant(engine.loglikelihood, requests, task)
    out = ShardOutcome([])
    _count_tokens(out, requests, scored)
    for r in rows:
        keys = windows.get(r["sample_id"], [])
        error = next((errors[k] for k in keys if k in errors), None) or \
            (EMPTY_PROMPT if r["status"] == RowStatus.ERROR else None)
        done = not error and r["sample_id"] in windows
        status = RowStatus.ERROR.value if error else r["status"]
        out.rows.append({"sample_id": r["sample_id"], "completion": 0, "status": status,
                         "error": error, "prompt": r["prompt"],
                         "latency_s": max((scored[k].latency_s or 0.0 for k in keys), default=None) if done else None,
                         "choice_logprobs": [sum(scored[k].logprobs[0] for k in keys)] if done else None,
                         "choice_greedy": [all(scored[k].greedy[0] for k in keys)] if done else None})
    return out


def _count_tokens(out: ShardOutcome, requests: list[LoglikRequest], scored: dict) -> None:
    """The prompt tokens of the requests that were scored, and those the engine computed for them (all of
    them where the engine does not say: it reads no cache)."""
    done = [(r, scored[r.sample_id]) for r in requests if r.sample_id in scored]
    asked = [sum(len(r.context_ids) + len(c) for c in r.continuations) for r, _ in done]
    out.prompt_tokens_requested = sum(asked)
    out.prompt_tokens_computed = sum(n if s.computed_tokens is None else s.computed_tokens
                                     for n, (_, s) in zip(asked, done))


def _key(sample_id: str, completion: int, n: int) -> str:
    """A request's id: the sample's, with the completion's index where there are several."""
    return sample_id if n == 1 else f"{sample_id}#{completion}"


def _prompt_ids(rows: list[dict], tokenizer, add_special_tokens: bool) -> None:
    """Token ids for each row: carried for truncated rows, else tokenized here and checked against the
    length the driver measured (a different tokenizer on this node would show)."""
    todo = [r for r in rows if r["prompt_token_ids"] is None]
    for r, ids in zip(todo, tokenize([r["prompt"] for r in todo], tokenizer, add_special_tokens)):
        _same_length(r, len(ids))
        r["prompt_token_ids"] = ids


def _same_length(row: dict, length: int) -> None:
    if length != row["prompt_tokens"]:
        raise ValueError(f"sample {row['sample_id']}: the driver measured {row['prompt_tokens']} prompt tokens, "
                         f"this actor {length}; the tokenizers differ between nodes")


def _call(call, requests: list) -> list:
    poisoned = set(filter(None, os.environ.get(FAIL_SAMPLES_ENV, "").split(",")))
    # a request's id is its sample's, or `<sample>#<completion>` when sampling.n > 1: either names it
    if poisoned and any({r.sample_id, r.sample_id.rpartition("#")[0]} & poisoned for r in requests):
        raise RuntimeError(f"injected engine failure ({FAIL_SAMPLES_ENV})")
    results = call(requests)
    if sorted(r.sample_id for r in results) != sorted(r.sample_id for r in requests):  # no row ok without its result
        raise RuntimeError(f"the engine answered {len(results)} of {len(requests)} requests, not each one once")
    return results


def _tolerant(call, requests: list, task: TaskSpec) -> tuple[dict, dict]:
    """Results and per-request errors by request id. If the batch raises and the task tolerates row errors
    (`fail_on_error` not True), the requests are run one by one so that only those that break are marked;
    more broken requests than the task allows fail the shard."""
    try:
        return {g.sample_id: g for g in _call(call, requests)}, {}
    except Exception:
        if task.fail_on_error is True:
            raise
    done, errors = {}, {}
    for request in requests:
        try:
            done[request.sample_id] = _call(call, [request])[0]
        except Exception as e:  # recorded in the row's `error` column; the limit below decides the shard
            errors[request.sample_id] = f"{type(e).__name__}: {e}"
    allowed = len(requests) if task.fail_on_error is False else task.fail_on_error * len(requests)
    if len(errors) > allowed:
        first = next(iter(errors.items()))
        raise RuntimeError(f"{len(errors)} of {len(requests)} rows failed, more than fail_on_error="
                           f"{task.fail_on_error} allows; first: sample {first[0]}: {first[1]}")
    return done, errors
