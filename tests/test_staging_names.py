"""Staged prompts of two (model, task) pairs whose names join the same way (model `a` with task `b.c`, and
model `a.b` with task `c`) stay apart: each shard reads its own task's rows."""

import json

from cluster.plan.plan_source import preflight
from cluster.inputs.spec_file import load_spec


def test_pairs_whose_names_join_alike_do_not_share_staged_prompts(tmp_path):
    for task, prefix in (("bc", "x"), ("c", "y")):
        with open(tmp_path / f"{task}.jsonl", "w") as f:
            f.writelines(json.dumps({"id": f"{prefix}{i}", "q": f"{prefix} question {i}"}) + "\n" for i in range(6))
    spec = {"name": "s", "output": "out",
            "models": [{"name": "a", "path": "builtin:tiny"}, {"name": "a.b", "path": "builtin:tiny"}],
            "tasks": [{"name": "b.c", "data": "bc.jsonl", "id_column": "id", "prompt": "{q}"},
                      {"name": "c", "data": "c.jsonl", "id_column": "id", "prompt": "{q}"}]}
    (tmp_path / "s.yaml").write_text(json.dumps(spec))
    for model in preflight(load_spec(tmp_path / "s.yaml")):
        for plan in model.tasks:
            prefix = "x" if plan.task.name == "b.c" else "y"
            for shard in plan.shards:
                rows = shard.rows.to_pylist()
                assert rows and all(r["sample_id"].startswith(prefix) for r in rows), (model.model.name, plan.task.name)
                assert all(r["prompt"].startswith(prefix) for r in rows)
