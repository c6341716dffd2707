"""An lm-eval model whose three request types go through one method, `_answer(kind, requests)`: the model
`raysweep lm-eval` registers (jobs/lm_eval_model.py) and the scoring pass's replay of committed rows
(cluster/lm_eval/scores.py). Imports lm-eval: imported only where it runs."""

from __future__ import annotations

from typing import Any, Callable

from lm_eval.api.model import LM


class TokenizerOnUse:
    """A model's tokenizer, loaded by `load()` at its first attribute read (cluster/inputs/model_files.py
    load_tokenizer: without torch where the folder allows)."""

    def __init__(self, load: Callable[[], Any]):
        self._load, self._tokenizer = load, None

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_load", "_tokenizer"):  # copy and pickle probes; before __init__
            raise AttributeError(name)
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return getattr(self._tokenizer, name)


class AnsweredLM(LM):
    """`tokenizer`, `eot_token_id` and `max_length` as lm-eval's vLLM model has them, once `described`: lm-eval's
    results record the tokenizer's special tokens and the model's length from them (lm_eval/loggers/utils.py
    add_tokenizer_info), and leave them out for a model without a tokenizer."""
    tokenizer = None
    max_length: int | None = None

    def described(self, load_tokenizer: Callable[[], Any] | None, max_length: int | None) -> "AnsweredLM":
        """The model's tokenizer (loaded by `load_tokenizer()` only when lm-eval reads it; None: none recorded) and
        its length (max_model_len)."""
        self.tokenizer = TokenizerOnUse(load_tokenizer) if load_tokenizer is not None else None
        self.max_length = max_length
        return self

    @property
    def eot_token_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    def _answer(self, kind: str, requests) -> list:
        raise NotImplementedError

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._answer("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._answer("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._answer("generate_until", requests)
