"""How a spec's model path reads: a builtin model's name, a path that can only be a local directory, or
(otherwise) a hub id unless such a folder exists."""

from __future__ import annotations

import os

BUILTIN_PREFIX = "builtin:"


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def is_local_path(path: str) -> bool:
    """A model path that can only be a local directory: absolute, `~`, `./` or `../` (or `.`, `..`), or with
    more than one `/` (a hub id is `name` or `org/name`). Others are local where such a folder exists."""
    return (os.path.isabs(path) or path.startswith(("~", "./", "../")) or path in (".", "..")
            or path.count("/") > 1)
