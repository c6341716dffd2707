"""How the vLLM engine reads a request's prompt log-probabilities (actors/vllm_engine.py `_prompt_logprobs`).

vLLM is not installed here: `StandInFlatLogprobs` has the fields and indexing of vLLM 0.26's
`vllm.logprobs.FlatLogprobs` (what `flat_logprobs=True` returns), and `StandInLogprob` those of its `Logprob`.
The GPU tests read real ones (tests/test_gpu.py, the log-likelihood test against the CPU engine)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

from actors.engine import GenRequest
from actors.vllm_engine import _prompt_logprobs


@dataclass
class StandInLogprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class StandInFlatLogprobs:
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    decoded_tokens: list = field(default_factory=list)

    def append(self, position: dict | None) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def __getitem__(self, index: int) -> dict:
        return {self.token_ids[i]: StandInLogprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}


PROMPT = [5, 9, 2, 9, 7]
POSITIONS = [None] + [{t: StandInLogprob(-0.5 * k, k)} for k, t in enumerate(PROMPT[1:], start=1)]
EXPECTED = [(-0.5, 1), (-1.0, 2), (-1.5, 3), (-2.0, 4)]


def _flat(positions) -> StandInFlatLogprobs:
    flat = StandInFlatLogprobs()
    for position in positions:
        flat.append(position)
    return flat


def test_the_flat_container_and_the_per_position_dicts_read_the_same():
    req = GenRequest("r#0", PROMPT, 0)
    assert _prompt_logprobs(req, SimpleNamespace(prompt_logprobs=POSITIONS)) == EXPECTED
    assert _prompt_logprobs(req, SimpleNamespace(prompt_logprobs=_flat(POSITIONS))) == EXPECTED


def test_a_flat_container_with_more_than_the_prompts_own_token_is_read_by_token_id():
    # prompt_logprobs=1: each position holds the prompt's token and the top token; the prompt's is looked up
    positions = [None] + [{t: StandInLogprob(-0.5 * k, k), 99: StandInLogprob(-0.01, 1)}
                          for k, t in enumerate(PROMPT[1:], start=1)]
    assert _prompt_logprobs(GenRequest("r#0", PROMPT, 0), SimpleNamespace(prompt_logprobs=_flat(positions))) == EXPECTED


def test_a_flat_container_of_the_prompts_own_tokens_is_read_whole_not_position_by_position():
    # what made flat_logprobs fast: no dict and no Logprob object per prompt token, in vLLM or here
    class Counted(StandInFlatLogprobs):
        reads = 0

        def __getitem__(self, index):
            Counted.reads += 1
            return super().__getitem__(index)

    flat = Counted()
    for position in POSITIONS:
        flat.append(position)
    assert _prompt_logprobs(GenRequest("r#0", PROMPT, 0), SimpleNamespace(prompt_logprobs=flat)) == EXPECTED
    assert Counted.reads == 0
