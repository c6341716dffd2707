"""Structured specs that compiled before against a tokenizer, so planning a sweep again does not compile them again.

Compiling is cheap; importing xgrammar to do it is not: it loads torch into the driver while the actors start
(the quickstart run again: bench/README.md, "Measurements behind choices in the code"). A spec that compiled leaves
an empty file under ~/.cache/raysweep/grammars/<tokenizer fingerprint>/, named by a digest of the spec, the xgrammar
version that compiled it and the code that made it a grammar (`to_grammar`, cluster/contracts/structured.py). The
tokenizer's fingerprint is the token cache's (cluster/inputs/token_cache.py): its files and the versions that read
them. A spec that did not compile leaves none, so its error is said again on every run. The cache is only added to;
one that cannot be written costs the next run a compile.
"""

from __future__ import annotations

import functools
import hashlib
import json
import marshal
from importlib.metadata import version
from pathlib import Path

from cluster.contracts.model_paths import cache_root
from cluster.contracts.spec import StructuredSpec
from cluster.contracts.structured import to_grammar
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
    text = json.dumps([_compiler(), spec.kind, spec.value], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _compiler() -> str:
    """What turns a spec into a compiled grammar: xgrammar's version and `to_grammar`'s code (any change to it, even
    of its lines' places, compiles every spec again once)."""
    return f"{version('xgrammar')} {hashlib.sha256(marshal.dumps(to_grammar.__code__)).hexdigest()[:16]}"
