"""How the vLLM engine reads a request's prompt log-probabilities (actors/vllm_prompt_logprobs.py `prompt_tail`), and how
its log-likelihood requests read the prefix cache and run again where the cache covered a choice
(`VllmEngine.loglikelihood`).

vLLM is not installed here: `StandInFlatLogprobs` has the fields and indexing of vLLM 0.26's
`vllm.logprobs.FlatLogprobs` (what `flat_logprobs=True` returns), and `StandInLogprob` those of its `Logprob`.
The GPU tests read real ones (tests/test_gpu.py, the log-likelihood test against the CPU engine)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

from actors.engine import GenRequest, LoglikRequest
from actors.vllm_engine import VllmEngine
from actors.vllm_prompt_logprobs import PromptTail, prompt_tail


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

    def __len__(self) -> int:
        return len(self.start_indices)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

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


def _scores(req: GenRequest, out) -> list:
    tail = prompt_tail(req, out, len(req.prompt_token_ids) - 1)  # every token after the first
    return tail.scores


def test_the_flat_container_and_the_per_position_dicts_read_the_same():
    req = GenRequest("r#0", PROMPT, 0)
    assert _scores(req, SimpleNamespace(prompt_logprobs=POSITIONS)) == EXPECTED
    assert _scores(req, SimpleNamespace(prompt_logprobs=_flat(POSITIONS))) == EXPECTED
    assert prompt_tail(req, SimpleNamespace(prompt_logprobs=POSITIONS, num_cached_tokens=0), 4).computed == len(PROMPT)


def test_a_flat_container_with_more_than_the_prompts_own_token_is_read_by_token_id():
    # prompt_logprobs=1: each position holds the prompt's token and the top token; the prompt's is looked up
    positions = [None] + [{t: StandInLogprob(-0.5 * k, k), 99: StandInLogprob(-0.01, 1)}
                          for k, t in enumerate(PROMPT[1:], start=1)]
    assert _scores(GenRequest("r#0", PROMPT, 0), SimpleNamespace(prompt_logprobs=_flat(positions))) == EXPECTED


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
    assert _scores(GenRequest("r#0", PROMPT, 0), SimpleNamespace(prompt_logprobs=flat)) == EXPECTED
    assert Counted.reads == 0


def test_after_a_cache_hit_only_the_positions_vllm_computed_are_read_with_either_runner():
    # 2 prompt tokens read from the prefix cache: logits from position 2 on, so the tokens at 3 and 4 are scored.
    # vLLM 0.26's model runner for Llama returns entries for those positions only ...
    req = GenRequest("r#0", PROMPT, 0)
    partial = [None] + POSITIONS[3:]
    for container in (partial, _flat(partial)):
        tail = prompt_tail(req, SimpleNamespace(prompt_logprobs=container, num_cached_tokens=2), 4)
        assert tail == PromptTail(EXPECTED[-2:], 3)
    # ... its older runner one per position, those before the hit never written (here: another token's values)
    unwritten = [None, {77: StandInLogprob(-9.0, 5)}, {PROMPT[2]: StandInLogprob(-3.0, 1)}] + POSITIONS[3:]
    for container in (unwritten, _flat(unwritten)):
        assert prompt_tail(req, SimpleNamespace(prompt_logprobs=container, num_cached_tokens=2), 4) == \
            PromptTail(EXPECTED[-2:], 3)


def test_an_entry_that_is_not_the_prompts_own_token_ends_the_tail():
    flat = _flat([None, POSITIONS[1], {55: StandInLogprob(-4.0, 2)}] + POSITIONS[3:])
    assert _scores(GenRequest("r#0", PROMPT, 0), SimpleNamespace(prompt_logprobs=flat)) == EXPECTED[-2:]


class ScriptedEngine(VllmEngine):
    """The engine's log-likelihood logic over scripted prompt tails: each prompt's tail is its tokens' values
    (-0.1 per token) cut to `covered` tokens where the cache is read, as vLLM does after a hit."""

    def __init__(self, covered: dict[tuple, int], prefix_caching: bool = True):
        self.args = {} if prefix_caching else {"enable_prefix_caching": False}
        self.covered, self.calls = covered, []

    def _prompt_tails(self, prompts, read_cache):
        self.calls.append((len(prompts), read_cache))
        tails = []
        for ids, _ in prompts:
            keep = self.covered.get(tuple(ids), len(ids) - 1) if read_cache else len(ids) - 1
            tails.append(PromptTail([(-0.1, 1)] * keep, keep + 1 if keep < len(ids) - 1 else len(ids)))
        return tails


def test_a_choice_the_cache_covered_runs_again_without_reading_the_cache_and_its_tokens_are_counted():
    ctx = [1, 2, 3, 4]
    requests = [LoglikRequest("a", ctx, [[5], [6, 7]]), LoglikRequest("b", [9, 9], [[8, 8, 8]])]
    # choice [6, 7] after a hit that reached its first token: one value left, two needed
    engine = ScriptedEngine({(1, 2, 3, 4, 5): 1, (1, 2, 3, 4, 6, 7): 1})
    a, b = engine.loglikelihood(requests)
    assert engine.calls == [(3, True), (1, False)]
    assert a.logprobs == [-0.1, -0.2] and a.greedy == [True, True]
    assert b.logprobs == [-0.1 * 3]
    assert a.computed_tokens == 2 + (2 + 6) and b.computed_tokens == 5


def test_with_prefix_caching_off_nothing_is_read_from_the_cache():
    engine = ScriptedEngine({}, prefix_caching=False)
    engine.loglikelihood([LoglikRequest("a", [1, 2], [[3]])])
    assert engine.calls == [(1, False)]


def test_a_shards_tokens_count_what_was_asked_and_what_the_engine_computed():
    """The shard telemetry's prompt_tokens_requested / _computed (actors/shard_work.py): an engine that reads no
    cache (computed_tokens None) computed what it was asked; a request that failed counts in neither."""
    from actors.engine import LoglikResult
    from actors.shard_work import ShardOutcome, _count_tokens

    requests = [LoglikRequest("a", [1, 2, 3], [[4], [5, 6]]), LoglikRequest("b", [1, 2], [[7]]),
                LoglikRequest("c", [9], [[8]])]
    scored = {"a": LoglikResult("a", [-1.0, -2.0], [True, True], 0.1, computed_tokens=5),
              "b": LoglikResult("b", [-1.0], [True], 0.1)}
    out = ShardOutcome([])
    _count_tokens(out, requests, scored)
    assert (out.prompt_tokens_requested, out.prompt_tokens_computed) == ((4 + 5) + 3, 5 + 3)


def test_only_the_choices_tokens_are_read():
    """`need` tokens from the end, not the context's: a context position holding another token (an unwritten
    row) is not looked at when the choice is the last two tokens; asked for more, the tail ends there."""
    flat = _flat([None, {77: StandInLogprob(-9.0, 5)}] + POSITIONS[2:])
    req = GenRequest("r#0", PROMPT, 0)
    assert prompt_tail(req, SimpleNamespace(prompt_logprobs=flat), 2).scores == EXPECTED[-2:]
    assert prompt_tail(req, SimpleNamespace(prompt_logprobs=flat), 4).scores == EXPECTED[-3:]
