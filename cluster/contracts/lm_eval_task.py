"""lm-evaluation-harness tasks in a spec (docs/lm-eval.md): the settings of a `lm_eval:` task entry, and what
each raysweep task made from it remembers of them.

A `lm_eval:` entry names lm-eval tasks or groups. At spec load (cluster/lm_eval/requests.py) lm-eval
itself builds their requests; each lm-eval task becomes one raysweep task over every model of the sweep:
- `generate_until`: a `generate` task, its sampling from the task's generation arguments;
- `loglikelihood` and `multiple_choice`: a `loglikelihood` task, a row per document (its requests' continuations
  as the row's choices, where they share one context; else a row per request);
- `loglikelihood_rolling`: a `loglikelihood` task whose one choice is the document, scored in lm-eval's
  rolling windows (`rolling_windows`, cluster/contracts/loglikelihood.py) by the actor.
After the sweep, lm-eval's own code scores and aggregates what the engines returned
(cluster/lm_eval/scores.py). This module imports nothing of lm-eval: actors read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

OUTPUT_TYPES = ("generate_until", "loglikelihood", "multiple_choice", "loglikelihood_rolling")
VERSION = "0.4.13"  # the lm-eval release raysweep's extra pins (pyproject.toml: raysweep[lm-eval])
EXTRA = "pip install 'raysweep[lm-eval]'"
# lm-eval's seeds when `--seed` is not given (random, numpy, torch, few-shot), as its simple_evaluate defaults them
DEFAULT_SEEDS = (0, 1234, 1234, 1234)


def _int_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _seeds(seed: Any) -> tuple | None:
    """`seed` as lm-eval's `--seed` takes it: one integer for all four generators, or four values (random,
    numpy, torch, few-shot), each an integer or None (that generator not seeded). None: neither."""
    values = [seed] * len(DEFAULT_SEEDS) if _int_or_none(seed) and seed is not None else seed
    if not isinstance(values, (list, tuple)) or len(values) != len(DEFAULT_SEEDS) or not all(map(_int_or_none, values)):
        return None
    return tuple(values)


def _samples(samples: Any) -> dict:
    """lm-eval's `--samples`: per task name, the indices of the documents to run, in increasing order without
    repeats (lm-eval pairs the n-th index listed with the n-th document it reads, so any other order would
    label documents wrongly in its records)."""
    if not isinstance(samples, dict) or not samples:
        raise ValueError(f"samples: a mapping of lm-eval task names to document indices (or a JSON file of one), "
                         f"got {samples!r}")
    for task, indices in samples.items():
        if not isinstance(task, str) or not task:
            raise ValueError(f"samples: task names as keys, got {task!r}")
        if (not isinstance(indices, (list, tuple)) or not indices
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)):
            raise ValueError(f"samples.{task}: a list of document indices (integers >= 0), got {indices!r}")
        if list(indices) != sorted(set(indices)):
            raise ValueError(f"samples.{task}: document indices in increasing order without repeats, as lm-eval "
                             f"labels its records by their order, got {list(indices)!r}")
    return {task: list(indices) for task, indices in samples.items()}


@dataclass(frozen=True)
class LmEvalSettings:
    """What lm-eval's `simple_evaluate` is given, as its command line names it."""
    tasks: tuple[str, ...]  # task or group names, as `--tasks`
    include_path: str | None = None  # a folder of task YAMLs (relative: from the spec's folder), as `--include_path`
    num_fewshot: int | None = None  # None: each task's own default
    fewshot_seed: int = 1234  # `--seed`'s fourth value: which documents become the few-shot examples
    # as `--seed`: one integer for lm-eval's four generators, or four (random, numpy, torch, few-shot; null: not
    # seeded); its fourth is the few-shot seed, so fewshot_seed is then left out. None: lm-eval's 0,1234,1234,1234
    seed: int | list | None = None
    limit: int | float | None = None  # documents per task: a count, or a fraction (< 1) of each task's
    apply_chat_template: bool = False  # the model's chat template (every model of the sweep must share it)
    fewshot_as_multiturn: bool = False  # with the chat template: few-shot examples as turns of the conversation
    system_instruction: str | None = None
    gen_kwargs: dict | None = None  # overrides of generate_until tasks' generation arguments, as `--gen_kwargs`
    bootstrap_iters: int = 100000  # stderr of metrics lm-eval bootstraps (0: none)
    confirm_run_unsafe_code: bool = False  # tasks lm-eval marks unsafe (code execution)
    predict_only: bool = False  # as `--predict_only`: the answers and lm-eval's records of them, no metrics
    # as `--samples`: per lm-eval task, the indices of the documents to run (in increasing order); not with limit
    samples: dict | None = None
    # as `--use_cache`: lm-eval's sqlite cache of answers (PATH_rank0.db), read when lm-eval scores the sweep's
    # answers: what it holds is taken, what it lacks is added (the sweep still runs every request); `{model}` in
    # it is the model's name (needed where the sweep has several models)
    use_cache: str | None = None

    def __post_init__(self) -> None:
        # a string as lm-eval's --tasks reads it: names separated by commas
        tasks = tuple(t.strip() for t in self.tasks.split(",")) if isinstance(self.tasks, str) else self.tasks
        if not isinstance(tasks, (list, tuple)) or not tasks or not all(isinstance(t, str) and t for t in tasks):
            raise ValueError(f"tasks: lm-eval task or group names (a list), got {self.tasks!r}")
        object.__setattr__(self, "tasks", tuple(tasks))
        if self.include_path is not None and (not isinstance(self.include_path, str) or not self.include_path):
            raise ValueError(f"include_path: a folder of lm-eval task YAMLs, got {self.include_path!r}")
        if not _int_or_none(self.num_fewshot) or (self.num_fewshot is not None and self.num_fewshot < 0):
            raise ValueError(f"num_fewshot: an integer >= 0, got {self.num_fewshot!r}")
        if not _int_or_none(self.fewshot_seed) or self.fewshot_seed is None:
            raise ValueError(f"fewshot_seed: an integer, got {self.fewshot_seed!r}")
        limit = self.limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not math.isfinite(limit) or limit <= 0
                                  or (isinstance(limit, float) and limit >= 1 and not limit.is_integer())):
            raise ValueError(f"limit: documents per task (an integer >= 1) or a fraction in (0, 1), got {limit!r}")
        for name in ("apply_chat_template", "fewshot_as_multiturn", "confirm_run_unsafe_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.fewshot_as_multiturn and not self.apply_chat_template:  # as lm-eval's command line refuses it
            raise ValueError("fewshot_as_multiturn: few-shot examples as turns need apply_chat_template: true")
        if self.system_instruction is not None and not isinstance(self.system_instruction, str):
            raise ValueError(f"system_instruction: must be a string, got {self.system_instruction!r}")
        if self.gen_kwargs is not None and not isinstance(self.gen_kwargs, dict):
            raise ValueError(f"gen_kwargs: a mapping of generation arguments, got {self.gen_kwargs!r}")
        if not _int_or_none(self.bootstrap_iters) or self.bootstrap_iters is None or self.bootstrap_iters < 0:
            raise ValueError(f"bootstrap_iters: an integer >= 0, got {self.bootstrap_iters!r}")
        if self.seed is not None:
            if _seeds(self.seed) is None:
                raise ValueError(f"seed: one integer, or four (random, numpy, torch, few-shot; null leaves one "
                                 f"unseeded) as lm-eval's --seed, got {self.seed!r}")
            object.__setattr__(self, "seed", _seeds(self.seed))
            if self.fewshot_seed not in (DEFAULT_SEEDS[3], self.seed[3]):
                raise ValueError(f"fewshot_seed: {self.fewshot_seed}, but seed's fourth value (the few-shot seed) "
                                 f"is {self.seed[3]}: give one of them")
        if not isinstance(self.predict_only, bool):
            raise ValueError(f"predict_only: must be true or false, got {self.predict_only!r}")
        if self.samples is not None:
            object.__setattr__(self, "samples", _samples(self.samples))
            if self.limit is not None:  # as lm-eval refuses them together
                raise ValueError("samples: lm-eval runs the documents of samples or of limit, not both: drop limit")
        if self.use_cache is not None and (not isinstance(self.use_cache, str) or not self.use_cache.strip()):
            raise ValueError(f"use_cache: the path of lm-eval's sqlite cache of answers, got {self.use_cache!r}")

    @property
    def seeds(self) -> tuple:
        """lm-eval's four seeds (random, numpy, torch, few-shot), as `--seed` and fewshot_seed give them."""
        return self.seed if self.seed is not None else (*DEFAULT_SEEDS[:3], self.fewshot_seed)

    def cache_of(self, model: str) -> str | None:
        """The `use_cache` path of one model's answers."""
        return None if self.use_cache is None else self.use_cache.replace("{model}", model)


@dataclass(frozen=True)
class LmEvalTask:
    """On a raysweep task made from a `lm_eval:` entry: which lm-eval task it is and the entry's settings."""
    task: str  # lm-eval's name of the task
    output_type: str  # one of OUTPUT_TYPES
    settings: LmEvalSettings
    # which `lm_eval:` entry of the spec it came from (its tasks are scored together); -1: made by `raysweep
    # lm-eval`, whose lm-eval process scores the answers itself
    entry: int = 0
    # hashes of its documents and of its requests as planned (cluster/lm_eval/run.py documents_hash,
    # requests_hash): scoring checks what it read again against them, a resume the documents; None: not taken
    documents: str | None = None
    requests: str | None = None

    def __post_init__(self) -> None:
        if self.output_type not in OUTPUT_TYPES:
            raise ValueError(f"{self.task}: lm-eval output type {self.output_type!r} is not one raysweep serves "
                             f"({', '.join(OUTPUT_TYPES)})")

    @property
    def rolling(self) -> bool:
        return self.output_type == "loglikelihood_rolling"
