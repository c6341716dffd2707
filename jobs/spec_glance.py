"""A quick look at a spec file before it is loaded (jobs/lifecycle.py `read`): what a command can begin on at once,
the engines' imports and Ray's start, while load_spec reads and checks the whole of it."""

from __future__ import annotations

import os


def quick_look(path: str) -> dict | None:
    """The spec file as YAML, or None where it is not readable YAML of a mapping (load_spec then says what is
    wrong, before anything starts)."""
    import yaml

    if not os.path.isfile(path):  # a named pipe would block open(); load_spec names what it is instead
        return None
    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
    except Exception:  # noqa: BLE001
        return None
    return raw if isinstance(raw, dict) else None


def backends_named(raw: dict) -> list[str]:
    """The engine backends the spec's models name (`engine: NAME` or `engine: {backend: NAME}`), `auto` for
    the rest and for what load_spec will refuse."""
    from cluster.contracts.spec import BACKENDS

    found = []
    for model in raw.get("models") if isinstance(raw.get("models"), list) else []:
        engine = model.get("engine") if isinstance(model, dict) else None
        backend = engine if isinstance(engine, str) else engine.get("backend") if isinstance(engine, dict) else None
        found.append(backend if backend in BACKENDS else "auto")
    return found or ["auto"]


def names_lm_eval_tasks(raw: dict) -> bool:
    """Whether the spec has a `lm_eval:` entry among its tasks (a quick look: load_spec checks it all)."""
    tasks = raw.get("tasks")
    return isinstance(tasks, list) and any(isinstance(t, dict) and "lm_eval" in t for t in tasks)
