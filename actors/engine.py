"""The Engine interface every backend implements (actors/engine_factory.py chooses and starts one).

An engine holds one model and turns requests (token ids + a per-sample seed) into completions. The
sampling and structured-output settings are per call (one task's shard). Backends:
- `hf`   (actors/hf_engine.py): transformers on CPU (or any torch device), xgrammar token masks.
- `vllm` (actors/vllm_engine.py): vLLM on a GPU, CUDA graphs, chunked prefill by profile, xgrammar.
- `fake` (actors/fake_engine.py): a fake that answers at once, for measuring orchestration alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from cluster.contracts.shard import SHORT
from cluster.contracts.spec import SamplingSpec, StructuredSpec


@dataclass(frozen=True)
class GenRequest:
    sample_id: str
    prompt_token_ids: list[int]
    seed: int  # used when temperature > 0


@dataclass
class GenResult:
    sample_id: str
    output_text: str
    output_tokens: int
    finish_reason: str  # stop (EOS, stop string or grammar end) | length
    latency_s: float | None  # request submitted -> last token
    ttft_s: float | None  # request submitted -> first token


@dataclass(frozen=True)
class LoglikRequest:
    """One multiple-choice row: its context and each choice's continuation, as token ids
    (cluster/contracts/loglikelihood.py: encode_pairs). Each choice is scored on context + continuation."""
    sample_id: str
    context_ids: list[int]
    continuations: list[list[int]]


@dataclass
class LoglikResult:
    sample_id: str
    logprobs: list[float]  # per choice: the sum of its tokens' log-probabilities given what precedes them
    greedy: list[bool]  # per choice: every one of its tokens was the most likely one
    latency_s: float | None  # request submitted -> every choice scored
    # prompt tokens the engine computed for the row, those read from its prefix cache not counted; None where
    # the engine computes every token it is asked (context + choice, once per choice)
    computed_tokens: int | None = None


@dataclass(frozen=True)
class EngineProfile:
    """How an engine is configured for a class of shards (docs/design.md, Planning)."""
    name: str = SHORT  # cluster/contracts/shard.py Profile
    chunked_prefill: bool = False
    max_num_batched_tokens: int | None = None


class Engine(Protocol):
    kind: str  # "hf" | "vllm"
    profile: EngineProfile

    def generate(self, requests: Sequence[GenRequest], sampling: SamplingSpec,
                 structured: StructuredSpec | None) -> list[GenResult]:
        """Completions in the order of `requests`."""

    def loglikelihood(self, requests: Sequence[LoglikRequest]) -> list[LoglikResult]:
        """Each choice's log-likelihood given its context, in the order of `requests` (raw log-softmax of
        the model's logits: no temperature or other processing)."""

    def startup(self) -> dict:
        """Measured start-up figures: engine_init_s (construction), warmup_s, load_s (both), compile_s,
        graph_capture_s, cuda_graphs, graph_mode, fallback_reason (None where not measured or not
        applicable)."""

    def sleep(self) -> None:
        """Give the accelerator's memory back while keeping the model, for a quick `wake_up` (engines made
        with `sleep_mode`: a pool replica that switches between models)."""

    def wake_up(self) -> None: ...

    def swap_weights(self, model_path: str) -> dict:
        """Load the weights of another checkpoint of the same model (actors/weight_swap.py) into this engine, in
        place; called while no shard is in flight. Returns {"weights_s": seconds}. The `hf` and `vllm` engines."""

    def close(self) -> None: ...


def runs_profile(engine: Engine, profile: EngineProfile) -> bool:
    """Whether `engine` can run a shard of `profile` without a restart. The CPU engine has no chunked
    prefill, so any profile runs on it; vLLM (and the fake, which stands in for it) restart for the other
    profile, not for another chunk size: a chunked engine runs a prompt of any length, whatever the chunk
    size the shard's task asked for (each task's threshold is its own, and a restart costs an engine start)."""
    if engine.kind == "hf":
        return True
    return engine.profile.name == profile.name and engine.profile.chunked_prefill == profile.chunked_prefill


def check_requests(requests: Sequence[GenRequest]) -> None:
    """Reject what no engine can run, with the sample named (vLLM refuses empty prompts too)."""
    for r in requests:
        if not r.prompt_token_ids:
            raise ValueError(f"sample {r.sample_id}: the prompt is empty (0 tokens)")


def check_loglik_requests(requests: Sequence[LoglikRequest]) -> None:
    """A choice is scored on the tokens before it: the context must hold one, and each choice a token."""
    for r in requests:
        if not r.context_ids:
            raise ValueError(f"sample {r.sample_id}: the context is empty (0 tokens): a choice's first token has "
                             "nothing to be predicted from")
        empty = next((j for j, c in enumerate(r.continuations) if not c), None)
        if empty is not None:
            raise ValueError(f"sample {r.sample_id}: choice {empty} is 0 tokens after the context")
