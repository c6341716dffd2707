"""An lm-eval model whose three request types go through one method, `_answer(kind, requests)`: the model
`raysweep lm-eval` registers (jobs/lm_eval_model.py) and the scoring pass's replay of committed rows
(cluster/lm_eval/scores.py). Imports lm-eval: imported only where it runs."""

from __future__ import annotations

from lm_eval.api.model import LM


class AnsweredLM(LM):
    def _answer(self, kind: str, requests) -> list:
        raise NotImplementedError

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._answer("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._answer("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._answer("generate_until", requests)
