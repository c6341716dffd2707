"""Writes the quickstart's three small tasks (seeded, so the files are reproducible):
arithmetic.jsonl (numeric answers), choice.jsonl (multiple choice A-D), extract.jsonl (JSON extraction).

    python sweeps/data/make_quickstart.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
FIRST = ["Maria", "Kenji", "Amara", "Lukas", "Priya", "Tomas", "Aiko", "Omar", "Sofia", "Ravi", "Elena", "Jonas",
         "Leila", "Mateo", "Nadia", "Hugo", "Ingrid", "Kwame", "Yara", "Felix"]
LAST = ["Lopez", "Tanaka", "Okafor", "Berg", "Sharma", "Novak", "Sato", "Haddad", "Rossi", "Iyer", "Petrova",
        "Lind", "Karimi", "Silva", "Kowalski", "Moreau", "Dahl", "Mensah", "Costa", "Weber"]
CITIES = ["Lisbon", "Osaka", "Lagos", "Oslo", "Pune", "Prague", "Kyoto", "Beirut", "Turin", "Chennai", "Sofia",
          "Bergen", "Tehran", "Recife", "Krakow", "Lyon", "Aarhus", "Accra", "Porto", "Munich"]
SENTENCES = ["{name}, {age}, lives in {city}.", "Meet {name} from {city}; {name} is {age} years old.",
             "In {city}, {name} (age {age}) runs a small bakery.", "{name} moved to {city} at the age of {age}."]
CATEGORIES = {"a color": ["red", "blue", "green", "yellow", "purple"], "an animal": ["horse", "otter", "eagle", "tiger"],
              "a fruit": ["apple", "mango", "cherry", "plum"], "a metal": ["iron", "copper", "silver", "zinc"]}


def arithmetic(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"id": f"arith-{i:03d}", "question": f"What is {a} {op} {b}?", "answer": str(value)})
    return rows


def choice(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        if i % 2:
            category = rng.choice(sorted(CATEGORIES))
            right = rng.choice(CATEGORIES[category])
            wrong = rng.sample([w for c, ws in CATEGORIES.items() if c != category for w in ws], 3)
            question = f"Which of these is {category}?"
        else:
            nums = rng.sample(range(10, 999), 4)
            right, wrong, question = str(max(nums)), [str(x) for x in nums if x != max(nums)], "Which number is the largest?"
        options = [right, *wrong]
        rng.shuffle(options)
        rows.append({"id": f"choice-{i:03d}", "question": question, **dict(zip("ABCD", options)),
                     "answer": "ABCD"[options.index(right)]})
    return rows


def extract(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        person = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(18, 90),
                  "city": rng.choice(CITIES)}
        rows.append({"id": f"extract-{i:03d}", "text": rng.choice(SENTENCES).format(**person), "person": person})
    return rows


def main() -> None:
    rng = random.Random(20261121)
    for name, rows in (("arithmetic", arithmetic(rng, 150)), ("choice", choice(rng, 100)),
                       ("extract", extract(rng, 100))):
        with open(HERE / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
