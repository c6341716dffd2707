"""How near two runs' lm-eval records lie, per document: raysweep's against lm-eval's (`agreement`), and a
checkpoint's records against other runs (`nearest_runs`), read from lm-eval's sample and results files
(`--log_samples`), which raysweep's `lm_eval:` entry writes too. Used by benchmarks/suite_8b.py."""

from __future__ import annotations

import glob
import json
import re
import statistics
from pathlib import Path

CHOICE_TASKS = ("mmlu", "hellaswag", "arc_challenge", "winogrande")
SAME_MODEL = 0.01  # nats: a choice's value this close to another run's is the same model's (bf16: within 0.001)
NEAR_TIE = 0.05  # nats: two choices this close in lm-eval's own values are a tie that bf16 rounding can turn


def samples(folder: Path, task: str) -> dict[tuple, dict]:
    """lm-eval's per-document records of a task and, for a group (mmlu), of all its subtasks: (subtask, doc)."""
    found = {}
    for path in glob.glob(f"{folder}/**/samples_{task}*.jsonl", recursive=True):
        sub = re.sub(r"_\d{4}-\d{2}-\d{2}T.*$", "", Path(path).name[len("samples_"):])
        if task != "mmlu" and sub != task:
            continue
        for r in map(json.loads, open(path)):
            if r.get("filter", "none") in ("none", "strict-match"):
                found[(sub, r["doc_id"])] = r
    return found


def choice_values(record: dict) -> list[float]:
    return [float(v[0]) for v in record["filtered_resps"]]


def decision_gaps(values: list[float], lengths: list[int] | None) -> tuple[int, float]:
    """The chosen index (lm-eval's argmax, of value / length for acc_norm) and its gap to the runner-up."""
    scores = [v / n for v, n in zip(values, lengths)] if lengths else values
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[0], (scores[order[0]] - scores[order[1]]) if len(order) > 1 else float("inf")


def choice_agreement(ours: dict, theirs: dict) -> dict:
    both = sorted(set(ours) & set(theirs))
    diffs, differ = [], {"acc": [], "acc_norm": []}
    for key in both:
        a, b = choice_values(ours[key]), choice_values(theirs[key])
        diffs += [abs(x - y) for x, y in zip(a, b)]
        lengths = [max(1, len(str(arg[1]))) for arg in theirs[key].get("arguments", [])] or None
        for metric, n in (("acc", None), ("acc_norm", lengths)):
            if metric not in theirs[key]:
                continue
            (pick_a, _), (pick_b, gap) = decision_gaps(a, n), decision_gaps(b, n)
            if pick_a != pick_b:
                differ[metric].append({"doc": list(key), "margin_lm_eval": round(gap, 5)})
    return {"documents": len(ours), "in_both": len(both),
            "choice_logliks": len(diffs), "max_abs_diff": max(diffs, default=None),
            "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
            "p99_abs_diff": sorted(diffs)[int(0.99 * (len(diffs) - 1))] if diffs else None,
            **{f"{m}_differ": len(v) for m, v in differ.items()},
            **{f"{m}_differ_near_ties": sum(d["margin_lm_eval"] < NEAR_TIE for d in v) for m, v in differ.items()},
            "differing": differ}


def agreement(ours: Path, theirs: Path) -> dict:
    figures = {task: choice_agreement(samples(ours, task), samples(theirs, task)) for task in CHOICE_TASKS}
    a, b = samples(ours, "gsm8k"), samples(theirs, "gsm8k")
    figures["gsm8k"] = {"documents": len(a), "in_both": len(set(a) & set(b)),
                        "same_response": sum(a[k]["resps"] == b[k]["resps"] for k in a if k in b)}
    results = [json.loads(Path(sorted(glob.glob(f"{d}/**/results_*.json", recursive=True))[-1]).read_text())["results"]
               for d in (ours, theirs)]
    figures["metrics"] = {task: {k: [results[0].get(task, {}).get(k), v] for k, v in results[1][task].items()
                                 if k != "alias"} for task in (*CHOICE_TASKS, "gsm8k") if task in results[1]}
    return figures


def nearest_runs(ours: Path, theirs: list[Path], within: float = SAME_MODEL) -> dict:
    """For each document of raysweep's records of one checkpoint (a choice task's), which of the runs `theirs`
    (lm-eval's of checkpoints, raysweep's records of the other checkpoints) its choices' values lie closest to, by
    the largest difference of a choice, counted per run (by folder name), and `none` where none lies within
    `within`: a checkpoint's documents found nearest another checkpoint's run say that its rows came from that
    checkpoint's engine."""
    runs = [{task: samples(folder, task) for task in CHOICE_TASKS} for folder in theirs]
    found = {}
    for task in CHOICE_TASKS:
        counts = {**{folder.name: 0 for folder in theirs}, "none": 0}
        for key, record in samples(ours, task).items():
            gaps = [(max((abs(x - y) for x, y in zip(choice_values(record), choice_values(run[task][key]))),
                         default=0.0), folder.name) for run, folder in zip(runs, theirs) if key in run[task]]
            gap, nearest = min(gaps, default=(float("inf"), "none"))
            counts[nearest if gap <= within else "none"] += 1
        found[task] = counts
    return found
