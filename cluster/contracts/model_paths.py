"""How a spec's model path reads: a builtin model's name, a path that can only be a local directory, or
(otherwise) a hub id unless such a folder exists; and raysweep's own cache folder (`cache_root`)."""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_PREFIX = "builtin:"


def cache_root() -> Path:
    """Where raysweep keeps what it builds: builtin models, token counts, lm-eval requests (RAYSWEEP_CACHE)."""
    return Path(os.environ.get("RAYSWEEP_CACHE", Path.home() / ".cache" / "raysweep"))


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def is_local_path(path: str) -> bool:
    """A model path that can only be a local directory: absolute, `~`, `./` or `../` (or `.`, `..`), or with
    more than one `/` (a hub id is `name` or `org/name`). Others are local where such a folder exists."""
    return (os.path.isabs(path) or path.startswith(("~", "./", "../")) or path in (".", "..")
            or path.count("/") > 1)
