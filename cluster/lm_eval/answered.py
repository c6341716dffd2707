"""An lm-eval model whose three request types go through one method, `_answer(kind, requests)`: the model
`raysweep lm-eval` registers (jobs/lm_eval_model.py); `AnswersFrom`, answering through a function: the scoring
pass's replay of committed rows (cluster/lm_eval/scores.py) and the building pass's recording of requests
(cluster/lm_eval/requests.py). Each renders chat templates with a tokenizer it is given (`templated`) as lm-eval's
HF model does. Imports lm-eval: imported only where it runs."""

from __future__ import annotations

import types
from typing import Any, Callable

import jinja2  # lm-eval's own dependency (lm_eval/utils.py renders its templates with it)
from lm_eval.api.model import LM, TemplateLM


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
    add_tokenizer_info), and leave them out for a model without a tokenizer. Once `templated` with a tokenizer,
    `apply_chat_template`, `chat_template` and `tokenizer_name` (which lm-eval's request cache and results name) as
    lm-eval's HF model has them; without one, lm-eval's `LM`'s."""
    tokenizer = None
    max_length: int | None = None
    chat_tokenizer = None

    def templated(self, tokenizer) -> "AnsweredLM":
        """Chat templates rendered with `tokenizer` (None: none)."""
        self.chat_tokenizer = tokenizer
        return self

    @property
    def tokenizer_name(self) -> str:
        if self.chat_tokenizer is None:
            return super().tokenizer_name
        return self.chat_tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if self.chat_tokenizer is None:
            return super().chat_template(chat_template)
        # lm-eval's own choice of template by the tokenizer's: one, or of several by name, "default" unless named
        return TemplateLM.chat_template(types.SimpleNamespace(tokenizer=self.chat_tokenizer), chat_template)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The tokenizer's rendering, without the system message where the template refuses one."""
        if self.chat_tokenizer is None:
            return super().apply_chat_template(chat_history, add_generation_prompt)

        def render(history):
            return self.chat_tokenizer.apply_chat_template(history, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt,
                                                           continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

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


class AnswersFrom(AnsweredLM):
    """An AnsweredLM whose answers are `answer(kind, requests)`'s."""

    def __init__(self, answer: Callable[[str, list], list]):
        super().__init__()
        self._answered_by = answer

    def _answer(self, kind: str, requests) -> list:
        return self._answered_by(kind, requests)
