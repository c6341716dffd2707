"""Staged rows: what planning rendered for one model x task, on the driver's local disk, read back by
position when a shard is dispatched, so the driver does not hold a sweep's prompts in memory.

One JSON record per sample, `[sample_id, prompt, target, truncated_token_ids | null, extra | null]`, appended in the
data file's order; a numpy array of byte offsets finds a record. The folder is a temporary one, removed
when the last object that can read it is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from array import array
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PREFIX = "raysweep-plan-"


class StagingFolder:
    """A temporary folder named after this process. A planner that was killed (SIGKILL, OOM) cannot
    remove its own, so each new one removes those whose process is gone."""

    def __init__(self) -> None:
        _remove_orphans(Path(tempfile.gettempdir()))
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.path), True)


def _remove_orphans(root: Path) -> None:
    for folder in root.glob(f"{PREFIX}*"):
        pid = folder.name[len(PREFIX):].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


class StagedRows:
    def __init__(self, folder: StagingFolder, name: str):
        self.folder = folder  # kept alive as long as these rows can be read
        self.name = name
        # named by a hash: a name is any length a spec allows, a file name at most 255 bytes
        self.path = folder.path / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.jsonl"
        self._out = open(self.path, "wb")
        self._ends = array("q")
        self._offsets: np.ndarray | None = None

    def append(self, sample_ids: Sequence[str], prompts: Sequence[str], targets: Sequence[Any],
               truncated: dict[int, list[int]], extras: Sequence[dict | None] | None = None) -> None:
        """One batch; `truncated` maps a position in this batch to its truncated token ids; `extras`: what
        each row carries beside (cluster/inputs/data.py: row_extra)."""
        end = self._ends[-1] if self._ends else 0
        lines = []
        extras = extras or [None] * len(sample_ids)
        for k, (sid, prompt, target, extra) in enumerate(zip(sample_ids, prompts, targets, extras)):
            line = json.dumps([sid, prompt, target, truncated.get(k), extra], ensure_ascii=False,
                              default=str).encode() + b"\n"
            end += len(line)
            self._ends.append(end)
            lines.append(line)
        self._out.write(b"".join(lines))

    def close(self) -> None:
        """Done writing: from here on, records can be read."""
        self._out.close()
        self._offsets = np.concatenate([[0], np.frombuffer(self._ends, dtype=np.int64)])
        self._ends = array("q")

    def read(self, positions: np.ndarray) -> list[list]:
        """The records at `positions`, in that order."""
        assert self._offsets is not None, "read before close()"
        starts, ends = self._offsets[positions], self._offsets[np.asarray(positions) + 1]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            lines = [os.pread(fd, int(e - b), int(b)) for b, e in zip(starts, ends)]
        finally:
            os.close(fd)
        return json.loads(b"[" + b",".join(lines) + b"]")  # one parse for the shard, not one per record
