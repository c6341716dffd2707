"""Writes the data of sweeps/scoring.yaml (seeded, so the files are reproducible), written for this repo:
- mc.jsonl: multiple choice for a `type: loglikelihood` task (a question, its choices, the right one's index);
  each choice starts with a space, which acc_norm counts in its length (lm-eval's convention does not: see
  `multiple_choice`);
- code.jsonl: small Python problems, each a function signature with a docstring, a `check` of its tests,
  and `completions`: three bodies written by hand (right, wrong, and one that never returns) that the replay
  task scores as if another harness had made them.

    python sweeps/data/make_scoring.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
KINDS = {"a color": ["red", "blue", "green", "yellow", "purple"], "an animal": ["horse", "otter", "eagle", "tiger"],
         "a fruit": ["apple", "mango", "cherry", "plum"], "a metal": ["iron", "copper", "silver", "zinc"]}

# (name, signature and docstring, tests, a right body, a wrong body)
PROBLEMS = [
    ("add", "def add(a, b):\n    \"\"\"Return a plus b.\"\"\"\n",
     ["f(1, 2) == 3", "f(-4, 4) == 0", "f(10, 5) == 15"], "    return a + b\n", "    return a - b\n"),
    ("is_even", "def is_even(n):\n    \"\"\"Whether n is even.\"\"\"\n",
     ["f(2) is True", "f(7) is False", "f(0) is True"], "    return n % 2 == 0\n", "    return n % 2 == 1\n"),
    ("reverse_words", "def reverse_words(s):\n    \"\"\"The words of s in reverse order, joined by one space.\"\"\"\n",
     ["f('a b c') == 'c b a'", "f('one') == 'one'"], "    return ' '.join(reversed(s.split()))\n",
     "    return s[::-1]\n"),
    ("count_vowels", "def count_vowels(s):\n    \"\"\"How many of the letters in s are vowels (aeiou, any case).\"\"\"\n",
     ["f('banana') == 3", "f('SKY') == 0", "f('AEiou') == 5"],
     "    return sum(c in 'aeiou' for c in s.lower())\n", "    return sum(c in 'aeiou' for c in s)\n"),
    ("largest", "def largest(xs):\n    \"\"\"The largest number in the non-empty list xs.\"\"\"\n",
     ["f([3, 9, 2]) == 9", "f([-5, -1]) == -1"], "    return max(xs)\n", "    return xs[0]\n"),
    ("fizz", "def fizz(n):\n    \"\"\"'Fizz' if n is divisible by 3, else str(n).\"\"\"\n",
     ["f(9) == 'Fizz'", "f(4) == '4'"], "    return 'Fizz' if n % 3 == 0 else str(n)\n", "    return str(n)\n"),
    ("squares", "def squares(n):\n    \"\"\"The squares of 1..n as a list.\"\"\"\n",
     ["f(3) == [1, 4, 9]", "f(0) == []"], "    return [i * i for i in range(1, n + 1)]\n",
     "    return [i * i for i in range(n)]\n"),
    ("initials", "def initials(name):\n    \"\"\"The capital initials of a full name: 'ada king lovelace' -> 'AKL'.\"\"\"\n",
     ["f('ada king lovelace') == 'AKL'", "f('Alan Turing') == 'AT'"],
     "    return ''.join(w[0].upper() for w in name.split())\n", "    return name[:2].upper()\n"),
]
NEVER_RETURNS = "    while True:\n        pass\n"


def multiple_choice(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        kind = rng.choice(sorted(KINDS))
        right = rng.choice(KINDS[kind])
        wrong = rng.sample([w for k, ws in KINDS.items() if k != kind for w in ws], 3)
        # The space before a choice is part of its text here, so raysweep's acc_norm divides by len + 1 bytes.
        # That differs from lm-eval's length convention: lm-eval keeps choices bare, adds the space as its
        # target_delimiter and measures the bare choice. The tokens are the same either way (split_pair);
        # for lm-eval's lengths, end the prompt with the space ("Answer: ") and write the choices bare.
        # Left as it is: the committed mc.jsonl and the outputs and figures made from it stay valid.
        choices = [" " + c for c in rng.sample([right, *wrong], 4)]
        rows.append({"id": f"mc-{i:03d}", "question": f"Which of these is {kind}?", "choices": choices,
                     "label": choices.index(" " + right)})
    return rows


def code() -> list[dict]:
    rows = []
    for name, prompt, tests, right, wrong in PROBLEMS:
        check = "def check(f):\n" + "".join(f"    assert {t}\n" for t in tests)
        rows.append({"id": name, "prompt": prompt, "test": check, "entry_point": name,
                     "completions": [right, wrong, NEVER_RETURNS]})
    return rows


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write("mc.jsonl", multiple_choice(random.Random(5), 40))
    write("code.jsonl", code())
