"""Benchmark inputs: lm-eval 0.4.13's own task definitions over local synthetic documents, and Llama models of a
builtin shape with a trained 32,000-token byte-level BPE vocabulary. No downloads.

    python -m benchmarks.suite_tasks --out DIR --fraction F [--model-seeds 1,2,3,4] [--shape large] [--seed 0]

1. `write_suite`: DIR/tasks, an lm-eval `--include_path`. Each task folder is copied from the installed lm_eval
   package, byte for byte, and each task YAML gets a block appended that says where the data comes from
   (`dataset_path: json`, `dataset_name: null`, `dataset_kwargs.data_files`). lm-eval's YAML loader (PyYAML) keeps
   the last of duplicate keys, and a file's own keys win over its `include:`; so doc_to_text, process_docs,
   metrics, few-shot settings, group files and `!function` modules stay lm-eval's, and task names stay theirs.
   lm-eval indexes an include path after its own tasks: a name in both is taken from here (one warning per
   name), and a tag (`multiple_choice`, `ai2_arc`, `mmlu_stem_tasks`, ...) is replaced by this folder's, not merged.
2. Documents: seeded synthetic records with the real datasets' fields and split sizes times `fraction` (at least
   one per evaluated split and subject), MMLU with its real per-subject test and validation counts. Few-shot
   pools are fixed: MMLU dev 5 per subject, HellaSwag/Winogrande/GSM8K train FEWSHOT_POOL, ARC train
   1,119 x max(fraction, 0.3). Text is `PseudoText`, an English-like pseudo-language whose word lengths per
   field follow the real datasets', so that a real-size BPE gives real-like prompt lengths.
3. `write_tokenizer`: a GPT-2-style byte-level BPE trained on the same pseudo-language.
4. `write_model`: `cluster.inputs.builtin_model`'s config and weights of a shape, with that vocabulary, in files of
   at most 5 GB as `save_pretrained` writes them.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import time
import zlib
from pathlib import Path

import numpy as np

from benchmarks.weight_files import MAX_SHARD_BYTES, write_weight_files
from cluster.inputs import builtin_model

# task -> (few-shot count the benchmark uses, folder in lm_eval/tasks, files copied from it)
SUITE = {
    "mmlu": (5, "mmlu/default", None),  # None: the whole folder
    "hellaswag": (10, "hellaswag", ("hellaswag.yaml", "utils.py")),
    "arc_challenge": (25, "arc", ("arc_easy.yaml", "arc_challenge.yaml")),
    "winogrande": (5, "winogrande", ("default.yaml", "preprocess_winogrande.py")),
    "gsm8k": (5, "gsm8k", ("gsm8k.yaml",)),
}
FEWSHOT_POOL = 300  # train documents of HellaSwag, Winogrande and GSM8K: enough to draw 10 shots from

# MMLU (cais/mmlu) per subject: (test, validation) documents; 14,042 and 1,531 in all
MMLU_COUNTS = dict(
    abstract_algebra=(100, 11), anatomy=(135, 14), astronomy=(152, 16), business_ethics=(100, 11),
    clinical_knowledge=(265, 29), college_biology=(144, 16), college_chemistry=(100, 8),
    college_computer_science=(100, 11), college_mathematics=(100, 11), college_medicine=(173, 22),
    college_physics=(102, 11), computer_security=(100, 11), conceptual_physics=(235, 26), econometrics=(114, 12),
    electrical_engineering=(145, 16), elementary_mathematics=(378, 41), formal_logic=(126, 14),
    global_facts=(100, 10), high_school_biology=(310, 32), high_school_chemistry=(203, 22),
    high_school_computer_science=(100, 9), high_school_european_history=(165, 18),
    high_school_geography=(198, 22), high_school_government_and_politics=(193, 21),
    high_school_macroeconomics=(390, 43), high_school_mathematics=(270, 29), high_school_microeconomics=(238, 26),
    high_school_physics=(151, 17), high_school_psychology=(545, 60), high_school_statistics=(216, 23),
    high_school_us_history=(204, 22), high_school_world_history=(237, 26), human_aging=(223, 23),
    human_sexuality=(131, 12), international_law=(121, 13), jurisprudence=(108, 11), logical_fallacies=(163, 18),
    machine_learning=(112, 11), management=(103, 11), marketing=(234, 25), medical_genetics=(100, 11),
    miscellaneous=(783, 86), moral_disputes=(346, 38), moral_scenarios=(895, 100), nutrition=(306, 33),
    philosophy=(311, 34), prehistory=(324, 35), professional_accounting=(282, 31), professional_law=(1534, 170),
    professional_medicine=(272, 31), professional_psychology=(612, 69), public_relations=(110, 12),
    security_studies=(245, 27), sociology=(201, 22), us_foreign_policy=(100, 11), virology=(166, 18),
    world_religions=(171, 19),
)
# mean question words where a subject departs from MMLU_QUESTION_WORDS (passages; overall mean about 45)
MMLU_LONG = dict(high_school_european_history=250, high_school_us_history=200, high_school_world_history=220,
                 professional_law=140, professional_medicine=100, professional_accounting=50,
                 professional_psychology=30, moral_scenarios=32, security_studies=25)
MMLU_QUESTION_WORDS = 20
# other evaluated splits and their real sizes; ARC-Easy is there because arc_challenge.yaml includes its file
SPLITS = {"hellaswag": {"validation": 10042}, "arc_challenge": {"test": 1172, "validation": 299},
          "arc_easy": {"test": 2376, "validation": 570}, "winogrande": {"validation": 1267}, "gsm8k": {"test": 1319}}
ARC_TRAIN = {"arc_challenge": 1119, "arc_easy": 2251}
# the copied YAMLs that define a task (not groups or templates), by their key in `_documents`' map
TASK_YAML = {"winogrande": "default.yaml", "hellaswag": "hellaswag.yaml", "gsm8k": "gsm8k.yaml",
             "arc_easy": "arc_easy.yaml", "arc_challenge": "arc_challenge.yaml",
             **{f"mmlu_{s}": f"mmlu_{s}.yaml" for s in MMLU_COUNTS}}
TOKENIZER_CORPUS_WORDS = 1_000_000  # about 6 MB of text
LEXICON_SIZE = 20_000
SYLLABLES_PER_WORD = (0.35, 0.4, 0.19, 0.06)
ZIPF_EXPONENT = 1.0
SUFFIXED, NUMBERS = 0.3, 0.02  # shares of running-text words
SUFFIXES = ("s", "ed", "ing", "er", "ly", "tion", "al", "ness", "ity", "ment")


@functools.lru_cache(maxsize=4)
def lexicon(seed: int) -> tuple[list[str], np.ndarray]:
    """The pseudo-language of `seed`: LEXICON_SIZE distinct words of 1-4 syllables, shortest first, and the
    cumulative Zipf frequency of each rank."""
    rng = np.random.Generator(np.random.PCG64(seed))
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "cr", "dr", "fl", "gr", "pl", "pr", "st", "str", "th", "sh", "ch", "tr", "sp", "qu"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "ee", "oa", "y"]
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "rt", "x"]
    syllables = np.array([o + n + c for o in onsets for n in nuclei for c in codas], dtype=object)
    words: dict[str, None] = {}
    while len(words) < LEXICON_SIZE:
        lengths = rng.choice(4, size=LEXICON_SIZE, p=SYLLABLES_PER_WORD) + 1
        picks = syllables[rng.integers(len(syllables), size=(LEXICON_SIZE, 4))]
        for row, k in zip(picks, lengths):
            words.setdefault("".join(row[:k]), None)
    ranked = sorted(list(words)[:LEXICON_SIZE], key=len)
    zipf = 1.0 / (np.arange(LEXICON_SIZE) + 2.7) ** ZIPF_EXPONENT
    return ranked, np.cumsum(zipf / zipf.sum())


class PseudoText:
    """Running text of the pseudo-language `lexicon(language)`, drawn from the stream `seed`: words with a
    Zipf frequency (short words the frequent ones), some with a suffix, some numbers, punctuated sentences."""

    def __init__(self, language: int, seed: int):
        self.words, self.cdf = lexicon(language)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def length(self, mean: float, sigma: float = 0.45, low: int = 1) -> int:
        """A lognormal word count with the given mean."""
        return max(low, int(round(self.rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma))))

    def tokens(self, n: int) -> list[str]:
        """n words of running text: lexicon words, SUFFIXED of them with a suffix, NUMBERS numbers."""
        ids = np.searchsorted(self.cdf, self.rng.random(n))
        kind, suffix = self.rng.random(n), self.rng.integers(len(SUFFIXES), size=n)
        digits = self.rng.integers(1, 5, size=n)
        return [str(int(self.rng.integers(1, 10 ** int(d)))) if k < NUMBERS
                else self.words[i] + SUFFIXES[s] if k < NUMBERS + SUFFIXED else self.words[i]
                for i, k, s, d in zip(ids, kind, suffix, digits)]

    def sentence(self, n: int, end: str = ".") -> str:
        """A capitalised sentence of n words, a comma now and then."""
        words = self.tokens(n)
        words[0] = words[0].capitalize()
        for i in np.nonzero(self.rng.random(n - 1) < 0.07)[0]:
            words[i] += ","
        return " ".join(words) + end

    def passage(self, n: int, end: str = ".") -> str:
        """About n words as sentences of 6-25 words, the last ending with `end`."""
        parts = []
        while n > 0:
            k = min(n, int(self.rng.integers(6, 26)))
            n -= k
            parts.append(self.sentence(k, end if n == 0 else "."))
        return " ".join(parts)

    def phrase(self, n: int) -> str:
        """n words, no final punctuation (answer options, labels)."""
        return " ".join(self.tokens(n))


def _count(real: int, fraction: float) -> int:
    return max(1, round(real * fraction))


def mmlu_docs(text: PseudoText, subject: str, n: int) -> list[dict]:
    """cais/mmlu records: question, subject, four choices, answer index."""
    mean = MMLU_LONG.get(subject, MMLU_QUESTION_WORDS)
    return [{"question": text.passage(text.length(mean, 0.6, 3), "?"), "subject": subject,
             "choices": [text.phrase(text.length(6, 0.6)) for _ in range(4)],
             "answer": int(text.rng.integers(4))} for _ in range(n)]


def hellaswag_docs(text: PseudoText, split: str, n: int) -> list[dict]:
    """Rowan/hellaswag records (label a string, as in the dataset)."""
    docs = []
    for i in range(n):
        ctx_a, ctx_b = text.passage(text.length(32, 0.5, 4)), text.phrase(text.length(8, 0.5))
        wikihow = text.rng.random() < 0.6
        docs.append({"ind": i, "activity_label": text.phrase(text.length(2, 0.4)).title(),
                     "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
                     "endings": [text.sentence(text.length(22, 0.5)) for _ in range(4)],
                     "source_id": f"wikihow~{text.rng.integers(100000)}" if wikihow
                     else f"activitynet~v_{text.rng.integers(10**10):010d}",
                     "split": "val" if split == "validation" else split,
                     "split_type": "indomain" if text.rng.random() < 0.5 else "zeroshot",
                     "label": str(text.rng.integers(4))})
    return docs


def arc_docs(text: PseudoText, split: str, n: int) -> list[dict]:
    """allenai/ai2_arc records: mostly four choices A-D, a few three or five."""
    docs = []
    for _ in range(n):
        k = int(text.rng.choice([3, 4, 5], p=[0.02, 0.96, 0.02]))
        labels = list("ABCDE"[:k])
        docs.append({"id": f"Mercury_{text.rng.integers(10**7):07d}",
                     "question": text.passage(text.length(22, 0.5, 4), "?"),
                     "choices": {"text": [text.phrase(text.length(4, 0.6)) for _ in range(k)], "label": labels},
                     "answerKey": labels[int(text.rng.integers(k))]})
    return docs


def winogrande_docs(text: PseudoText, split: str, n: int) -> list[dict]:
    """allenai/winogrande records: one blank `_` in the sentence, two options, answer "1" or "2"."""
    docs = []
    for _ in range(n):
        words = text.sentence(text.length(20, 0.3, 6)).split(" ")
        words[int(text.rng.integers(2, len(words) - 1))] = "_"
        docs.append({"sentence": " ".join(words), "option1": text.phrase(1).title(),
                     "option2": text.phrase(1).title(), "answer": str(text.rng.integers(1, 3))})
    return docs


def gsm8k_docs(text: PseudoText, split: str, n: int) -> list[dict]:
    """openai/gsm8k records: a word problem, and worked steps with <<a*b=c>> calculations ending in #### N."""
    docs = []
    for _ in range(n):
        steps, total = [], 0
        for _ in range(int(text.rng.integers(2, 5))):
            a, b = (int(x) for x in text.rng.integers(2, 60, size=2))
            total += a * b
            steps.append(f"{text.sentence(text.length(9, 0.5, 3))[:-1]} {a} * {b} = <<{a}*{b}={a * b}>>{a * b}.")
        steps.append(f"{text.sentence(text.length(6, 0.5, 2))[:-1]} {total}.")
        docs.append({"question": text.passage(text.length(45, 0.4, 10), "?"),
                     "answer": " ".join(steps) + f"\n#### {total}"})
    return docs


def _write_jsonl(path: Path, docs: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path.resolve())


def _documents(data: Path, fraction: float, seed: int) -> dict[str, dict[str, str]]:
    """Write every split's JSONL under `data`; returns {yaml stem or mmlu subject: {split: path}}."""

    def text(name: str) -> PseudoText:  # one stream per dataset and split: they do not shift each other
        return PseudoText(seed, zlib.crc32(f"{seed}:{name}".encode()))

    files: dict[str, dict[str, str]] = {}
    for subject, (test, validation) in MMLU_COUNTS.items():
        t = text(f"mmlu:{subject}")
        files[f"mmlu_{subject}"] = {split: _write_jsonl(data / "mmlu" / f"{subject}_{split}.jsonl",
                                                        mmlu_docs(t, subject, n))
                                    for split, n in (("test", _count(test, fraction)), ("dev", 5),
                                                     ("validation", _count(validation, fraction)))}
    pools = {"hellaswag": FEWSHOT_POOL, "winogrande": FEWSHOT_POOL, "gsm8k": FEWSHOT_POOL,
             **{name: round(real * max(fraction, 0.3)) for name, real in ARC_TRAIN.items()}}
    makers = {"hellaswag": hellaswag_docs, "arc_challenge": arc_docs, "arc_easy": arc_docs,
              "winogrande": winogrande_docs, "gsm8k": gsm8k_docs}
    for name, splits in SPLITS.items():
        counts = {**{split: _count(n, fraction) for split, n in splits.items()}, "train": pools[name]}
        files[name] = {split: _write_jsonl(data / name / f"{split}.jsonl",
                                           makers[name](text(f"{name}:{split}"), split, n))
                       for split, n in counts.items()}
    return files


def write_suite(out: Path, fraction: float, seed: int = 0) -> Path:
    """Write out/data (JSONL) and out/tasks (lm-eval's task folders, data pointed at out/data); returns out/tasks,
    the `--include_path`. Deterministic in (fraction, seed)."""
    import lm_eval

    if not 0 < fraction <= 1:
        raise ValueError(f"fraction: {fraction} is not in (0, 1]")
    source, tasks = Path(lm_eval.__file__).parent / "tasks", Path(out) / "tasks"
    shutil.rmtree(tasks, ignore_errors=True)
    folders = {}
    for _, folder, names in SUITE.values():
        target = tasks / folder.replace("/", "_")
        target.mkdir(parents=True)
        for path in sorted((source / folder).iterdir()) if names is None else (source / folder / n for n in names):
            if path.is_file():
                shutil.copyfile(path, target / path.name)
                folders[path.name] = target
    for key, data_files in _documents(Path(out) / "data", fraction, seed).items():
        yaml_path = folders[TASK_YAML[key]] / TASK_YAML[key]
        with yaml_path.open("a") as f:
            f.write("\n# data: local synthetic documents (benchmarks/suite_tasks.py); these keys override the above\n"
                    "dataset_path: json\ndataset_name: null\n"
                    f"dataset_kwargs:\n  data_files: {json.dumps(data_files)}\n")
    return tasks


def write_tokenizer(out: Path, vocab_size: int = 32000, seed: int = 0) -> None:
    """Train a byte-level BPE (GPT-2 regex pre-tokenizer, ByteLevel decoder) of exactly `vocab_size` tokens on
    about 6 MB of PseudoText; write it in Hugging Face form (AutoTokenizer loads it). Special tokens are
    builtin_model.SPECIAL_TOKENS (ids 0-7: `<|end|>`, `<|pad|>`, `<|bos|>`, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = PseudoText(seed, zlib.crc32(f"{seed}:tokenizer".encode()))
    corpus = [text.passage(1000) for _ in range(TOKENIZER_CORPUS_WORDS // 1000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(builtin_model.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer, length=len(corpus))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size: trained {tok.get_vocab_size()} tokens, not {vocab_size} (corpus too small)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768, **special,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": builtin_model.CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_model(out: Path, seed: int, shape: str = "large", vocab_size: int = 32000,
                tokenizer_from: Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """A Llama model directory of builtin_model.CONFIGS[shape] with the BPE vocabulary and weights drawn from
    `seed`, in files of at most `max_shard_bytes` (benchmarks/weight_files.py); the tokenizer trained here, or
    copied from `tokenizer_from` (a write_tokenizer directory)."""
    from tokenizers import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        write_tokenizer(out, vocab_size)
    else:
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_from) / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size: the tokenizer has {tok.get_vocab_size()} tokens, not {vocab_size}")
    ids = {key: tok.token_to_id(t) for key, t in
           (("bos_token_id", "<|bos|>"), ("eos_token_id", "<|end|>"), ("pad_token_id", "<|pad|>"))}
    config = {**builtin_model.builtin_config(shape), "vocab_size": vocab_size, **ids}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    cfg = builtin_model.CONFIGS[shape]
    write_weight_files(out, builtin_model.weight_tensors(config, seed, cfg.get("init", "normal"),
                                                         np.dtype(cfg.get("storage", "float32"))), max_shard_bytes)
    return out


def prompt_lengths(tasks: Path, tokenizer_dir: Path, first: int = 20) -> dict[str, tuple[int, float, int]]:
    """Per SUITE task: (documents evaluated, mean and max tokens of the full few-shot context of its first
    `first` documents at SUITE's shot count), built by lm-eval's own TaskManager and `fewshot_context`. For mmlu,
    over the first documents of every subject, the mean weighted by the subjects' sizes."""
    from lm_eval.tasks import TaskManager
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    manager = TaskManager(include_path=str(tasks))
    out = {}
    for name, (shots, _, _) in SUITE.items():
        docs, weighted, longest = 0, 0.0, 0
        for task in manager.load([name])["tasks"].values():
            task.set_config(key="num_fewshot", value=shots)
            task.set_fewshot_seed(seed=1234)
            evaluated = list(task.eval_docs)
            lengths = [_context_tokens(tok, task.fewshot_context(doc, shots)) for doc in evaluated[:first]]
            docs += len(evaluated)
            weighted += len(evaluated) * sum(lengths) / len(lengths)
            longest = max(longest, *lengths)
        out[name] = (docs, weighted / docs, longest)
    return out


def _context_tokens(tok, context: str | list[str]) -> int:
    """Tokens of a context; of the longest where a task gives one per choice (winogrande)."""
    return max(len(tok.encode(c).ids) for c in ([context] if isinstance(context, str) else context))


def main(argv: list[str] | None = None) -> None:
    """Write DIR/tasks, DIR/tokenizer and DIR/model-SEED for each model seed; print what was written."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite_tasks", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fraction", type=float, required=True, help="share of each evaluated split, (0, 1]")
    parser.add_argument("--model-seeds", default="1,2,3,4", help="comma-separated; empty for no model")
    parser.add_argument("--shape", default="large", choices=sorted(builtin_model.CONFIGS))
    parser.add_argument("--seed", type=int, default=0, help="the pseudo-language and the documents")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tasks = write_suite(args.out, args.fraction, args.seed)
    print(f"[suite] tasks {tasks} ({_size(args.out / 'data')} of data) in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    write_tokenizer(args.out / "tokenizer", seed=args.seed)
    print(f"[suite] tokenizer {args.out / 'tokenizer'} in {time.perf_counter() - started:.1f} s")
    for seed in [int(s) for s in args.model_seeds.split(",") if s.strip()]:
        started = time.perf_counter()
        model = write_model(args.out / f"model-{seed}", seed, args.shape, tokenizer_from=args.out / "tokenizer")
        print(f"[suite] model {model} ({args.shape}, {_size(model)}) in {time.perf_counter() - started:.1f} s")
    for name, (docs, mean, longest) in prompt_lengths(tasks, args.out / "tokenizer").items():
        print(f"[suite] {name}: {docs} documents, {SUITE[name][0]}-shot prompt tokens (first 20 documents"
              f"{' of each subject' if name == 'mmlu' else ''}): mean {mean:.0f}, max {longest}")


def _size(path: Path) -> str:
    total = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return f"{total / 2**20:.1f} MiB"


if __name__ == "__main__":
    main()
