"""A shard and its states: the unit of work the driver cuts, an actor runs, and the store commits once.

- `Shard`: rows of one model x task, in length order, with the engine profile they run under. On the driver
  its rows are staged on local disk (cluster/inputs/staging.py); shipped to an actor it carries them.
- `ShardState`: a shard's state in the manifest (cluster/store/): pending -> committed, or failed.
- `RowStatus` / `STATUSES`: a results row's status (ok, truncated, skipped, error), the one spelling of them.
- `ActorState` / `ActorCall`: where an actor slot of the scheduler stands, and what a call to it in flight is for.
- Seeds: each sample's seed derives from the task's seed and the sample id, each completion's from that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

import numpy as np
import pyarrow as pa


class RowRecords(Protocol):
    """Rows staged on the driver's disk, read back by record position (cluster/inputs/staging.py StagedRows):
    each record `[sample_id, prompt, target, truncated_token_ids | None, extra | None]`."""

    def read(self, positions: np.ndarray) -> list[list]: ...


class Profile(str, Enum):
    """A shard's engine profile: chunked prefill off (short prompts) or on (long ones, chunks of the shard's
    `max_num_batched_tokens`). A str: it is stored, sent and printed as its value."""
    SHORT = "short"
    LONG = "long"

    __str__ = str.__str__  # "short", not "Profile.SHORT", in lines and names (as Python 3.11's StrEnum)
    __format__ = str.__format__


SHORT, LONG = Profile.SHORT, Profile.LONG


class RowStatus(str, Enum):
    """A results row's status; `STATUSES` is the code order planning stores them in (0-3)."""
    OK = "ok"
    TRUNCATED = "truncated"  # its prompt was cut from the left to fit (length_policy: truncate_left)
    SKIPPED = "skipped"  # its prompt did not fit and the policy skips it: never run
    ERROR = "error"  # it could not run or raised; `error` says why


STATUSES = tuple(s.value for s in RowStatus)  # ("ok", "truncated", "skipped", "error"), coded 0-3
GENERATED = (RowStatus.OK, RowStatus.TRUNCATED)  # rows an engine ran: their output is the model's
NOT_RUN = (RowStatus.SKIPPED, RowStatus.ERROR)  # rows planning set aside (over the length, an empty prompt)
EMPTY_PROMPT = "the prompt is empty (0 tokens)"  # an `error` row's error: no engine can run it


class ShardState(str, Enum):
    """A shard's state in the manifest. Pending until its results file is renamed into place and recorded
    (committed), or until every attempt failed (failed: a new run tries it again)."""
    PENDING = "pending"
    COMMITTED = "committed"
    FAILED = "failed"


class ActorState(str, Enum):
    """Where an actor slot of the scheduler stands (cluster/schedule/work.py Slot): its process importing,
    up with no engine (idle), starting an engine for a model, running that model's shards (engines lent to the
    sweep, cluster/schedule/engine_sources.py, are running from the start)."""
    IMPORTING = "importing"
    IDLE = "idle"
    STARTING = "starting"
    RUNNING = "running"


class ActorCall(str, Enum):
    """What a call of the scheduler's to an actor slot is for (cluster/schedule/work.py InFlight): the actor's
    process up, its imports done (ready); an engine started for a model (start); a shard run (shard)."""
    READY = "ready"
    START = "start"
    SHARD = "shard"


# the actor method each kind of call is made on (actors/evaluator.py's; a lent engine's handle answers
# run_shard the same way: cluster/schedule/engine_sources.py)
ACTOR_METHODS = {ActorCall.READY: "ready", ActorCall.START: "start_engine", ActorCall.SHARD: "run_shard"}


@dataclass(frozen=True, eq=False)
class Shard:
    shard_id: str  # "<model>/<task>/<index:05d>", stable for the same spec and data
    index: int
    model: str
    task: str
    profile: str  # short | long
    max_num_batched_tokens: int | None  # the chunk size for `long` shards
    add_special_tokens: bool  # how the prompts are tokenized (False for chat-rendered text)
    seed_base: int  # the task's sampling seed: per-sample seeds derive from it
    source: RowRecords | pa.Table  # the driver's staged rows, or the rows themselves once shipped
    positions: np.ndarray | None = None  # record positions in `source` (staged rows only)
    prompt_tokens: np.ndarray | None = None  # measured lengths, in shard order (staged rows only)
    status: np.ndarray | None = None  # STATUSES codes, in shard order (staged rows only)

    @property
    def n_samples(self) -> int:
        return self.source.num_rows if isinstance(self.source, pa.Table) else len(self.positions)

    @property
    def rows(self) -> pa.Table:
        """sample_id, prompt, prompt_token_ids (truncated rows only), prompt_tokens, seed, status, choices
        (loglikelihood rows only), window (rolling rows only)."""
        if isinstance(self.source, pa.Table):
            return self.source
        records = self.source.read(self.positions)
        ids = [r[0] for r in records]
        return pa.table({
            "sample_id": pa.array(ids, pa.string()),
            "prompt": pa.array([r[1] for r in records], pa.string()),
            "prompt_token_ids": pa.array([r[3] for r in records], pa.list_(pa.int32())),
            "prompt_tokens": pa.array(self.prompt_tokens, pa.int32()),
            "seed": pa.array([sample_seed(self.seed_base, self.task, sid) for sid in ids], pa.int64()),
            "status": pa.array([STATUSES[c] for c in self.status], pa.string()),
            "choices": pa.array([(r[4] or {}).get("choices") for r in records], pa.list_(pa.string())),
            # lm-eval's loglikelihood_rolling rows: the tokens each window predicts at most (cluster/contracts/loglikelihood.py)
            "window": pa.array([(r[4] or {}).get("window") for r in records], pa.int32()),
        })

    def targets(self) -> list:
        """Targets in shard order, for scoring on the driver (where the rows are staged)."""
        return [r[2] for r in self.source.read(self.positions)]

    def extras(self) -> list[dict]:
        """What each row carries beside its prompt (cluster/inputs/data.py: row_extra), in shard order, on the driver."""
        return [r[4] or {} for r in self.source.read(self.positions)]

    def piece(self, start: int, stop: int) -> "Shard":
        """Rows [start, stop) of this shard, in its order, as a shard of their own with the same id: a
        part that bisection runs apart (cluster/schedule/bisection.py); only the whole shard is ever committed."""
        if isinstance(self.source, pa.Table):
            return replace(self, source=self.source.slice(start, stop - start))
        return replace(self, positions=self.positions[start:stop],
                       prompt_tokens=self.prompt_tokens[start:stop], status=self.status[start:stop])

    def __reduce__(self):
        """Shipped to an actor (pickled) with its rows: the staged file is on the driver's disk only."""
        return (Shard, (self.shard_id, self.index, self.model, self.task, self.profile,
                        self.max_num_batched_tokens, self.add_special_tokens, self.seed_base, self.rows))


def sample_seed(base: int, task: str, sample_id: str) -> int:
    digest = hashlib.blake2b(f"{base}\0{task}\0{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def completion_seed(seed: int, completion: int) -> int:
    """The seed of a sample's completion `completion` (of sampling.n): the sample's own for the first, so a
    task with n = 1 samples as it always did, and one derived from it for each other."""
    if completion == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}\0{completion}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF
