"""Structured specs that compiled before against a tokenizer, so planning a sweep again does not compile them again.

Compiling is cheap; importing xgrammar to do it is not: it loads torch into the driver while the actors start
(the quickstart run again: bench/README.md, "Measurements behind choices in the code"). A spec that compiled leaves
an empty file under ~/.cache/raysweep/grammars/<tokenizer fingerprint>/, named by a digest of the spec and the
xgrammar version that compiled it (cluster/inputs/token_cache.py fingerprints the tokenizer: its files and the
versions that read them). A spec that did not compile leaves none, so its error is said again on every run. The
cache is only added to; one that cannot be written costs the next run a compile.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from pathlib import Path

from cluster.contracts.model_paths import cache_root
from cluster.contracts.spec import StructuredSpec
from cluster.inputs.token_cache import fingerprint


class CompiledBefore:
    """The specs that compiled before against one tokenizer: `spec in compiled`, `compiled.add(spec)`."""

    def __init__(self, tokenizer, root: Path | None = None):
        self.folder = (root or cache_root() / "grammars") / fingerprint(tokenizer)

    def __contains__(self, spec: StructuredSpec) -> bool:
        return (self.folder / _key(spec)).is_file()

    def add(self, spec: StructuredSpec) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / _key(spec)).touch()
        except OSError:  # a cache folder not writable: the next run compiles the spec again
            pass


def _key(spec: StructuredSpec) -> str:
    text = json.dumps([version("xgrammar"), spec.kind, spec.value], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
