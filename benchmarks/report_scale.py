"""A synthetic sweep output of 1,000,000 rows for timing `raysweep report` at scale (bench/README.md#report):
2 models x 5 tasks x 100,000 samples in shard files of 1,000 rows, with its manifest and summary, written as
the sink writes them. `python -m benchmarks.report_scale OUT`, then `time raysweep report OUT`."""

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.score.summary import SummaryAccumulator
from cluster.store.output_files import result_file


def main(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng, shards, acc = random.Random(0), {}, SummaryAccumulator()
    for model in ("alpha", "beta"):
        for t in range(5):
            task = f"task{t}"
            for k in range(100):
                n = 1000
                ids = [f"s{k * n + i}" for i in range(n)]
                score = [float(rng.random() < (0.5 if model == "alpha" else 0.6)) for _ in ids]
                table = pa.table({"sweep": ["big"] * n, "model": [model] * n, "task": [task] * n, "sample_id": ids,
                                  "shard_id": [f"{model}/{task}/{k:05d}"] * n, "completion": pa.array([0] * n, pa.int32()),
                                  "status": ["ok"] * n, "score": score, "target": ["7"] * n,
                                  "prompt": [f"Question {i}: " + "lorem ipsum " * 40 for i in ids],
                                  "output_text": ["answer " * 30] * n, "output_tokens": pa.array([30] * n, pa.int32())})
                rel = result_file(model, task, k)
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(table, root / rel)
                shards[f"{model}/{task}/{k:05d}"] = {"state": "committed", "file": rel, "rows": n, "attempts": 1}
                acc.add(table)
    (root / "manifest.json").write_text(json.dumps({"sweep": "big", "spec_hash": "0" * 16, "shards": shards}))
    pq.write_table(acc.table(), root / "summary.parquet")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
