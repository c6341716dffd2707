"""Bisection without Ray (cluster/schedule/bisection.py): which parts run, which rows end as error rows, when it gives
up, and how a task's fail_on_error judges the result. The whole path through Ray and the CPU engine is in
tests/test_reliability.py; the scheduler's side in tests/test_scheduler.py."""

from collections import deque
from types import SimpleNamespace

import pyarrow as pa
import pytest

from cluster.schedule.bisection import Bisection, should_bisect
from cluster.schedule.commit import row_error_excess
from cluster.contracts.shard import Shard

RESULTS = pa.schema([("sample_id", pa.string()), ("output_text", pa.string()), ("status", pa.string()),
                     ("error", pa.string())])
BOOM = "RuntimeError: boom"


def shard(n: int) -> Shard:
    return Shard("m/t/00000", 0, "m", "t", "short", None, True, 0, pa.table({"sample_id": [f"r{i}" for i in range(n)]}))


def bisect(n: int, fails) -> tuple[Bisection, int]:
    """Runs a bisection of an n-row shard to its end, parts one at a time; `fails(ids)`: whether a part raises."""
    b = Bisection(SimpleNamespace(shard=shard(n), errors=[BOOM, BOOM], task=None))
    queue, parts = deque(b.start()), 0
    while queue and not b.settled:
        piece = queue.popleft()
        parts += 1
        ids = piece.shard.rows["sample_id"].to_pylist()
        if fails(ids):
            queue.extend(b.part_failed(piece, BOOM))
        else:
            table = pa.table({"sample_id": ids, "output_text": [f"out {i}" for i in ids], "status": ["ok"] * len(ids),
                              "error": [None] * len(ids)}, schema=RESULTS)
            queue.extend(b.part_ran(piece, table))
    assert b.settled
    return b, parts


def test_one_bad_row_is_an_error_row_and_the_others_keep_their_results():
    b, parts = bisect(12, lambda ids: "r5" in ids)
    assert b.gave_up is None and b.row_errors() == {"r5": BOOM}
    table = b.table().to_pylist()
    assert [r["sample_id"] for r in table] == [f"r{i}" for i in range(12)]  # the shard's order, each once
    assert table[5] == {"sample_id": "r5", "output_text": None, "status": "error", "error": BOOM}
    assert all(r["status"] == "ok" and r["output_text"] == f"out {r['sample_id']}"
               for r in table if r["sample_id"] != "r5")
    assert parts <= 2 * 4  # two parts per level, ceil(log2 12) levels


def test_bad_rows_in_both_halves_are_both_found():
    b, _ = bisect(12, lambda ids: {"r1", "r10"} & set(ids))
    assert b.gave_up is None and b.row_errors() == {"r1": BOOM, "r10": BOOM}
    assert [r["status"] for r in b.table().to_pylist()].count("ok") == 10


def test_a_shard_whose_every_part_fails_fails_whole_after_six_parts():
    """An engine that fails every call: not a row's failure. The halves and quarters fail, nothing ran, and
    the shard fails as before rather than become 512 single-row jobs and 512 error rows."""
    b, parts = bisect(512, lambda ids: True)
    assert parts == 6 and b.gave_up.startswith("bisected into 6 parts, none of which ran")
    assert b.gave_up.endswith(f"last: {BOOM}")


@pytest.mark.parametrize("n", [2, 3])
def test_a_row_is_blamed_only_where_rows_beside_it_ran(n):
    b, _ = bisect(n, lambda ids: True)  # every single row failed, but none ran beside them: the shard fails
    assert b.gave_up.startswith(f"bisected into {2 if n == 2 else 4} parts, none of which ran")


def test_parts_wait_for_evidence_and_go_on_once_a_row_ran():
    """Bad rows in three quarters of the shard: the quarters that fail wait until the fourth runs, then go on."""
    b, _ = bisect(16, lambda ids: {"r1", "r5", "r9"} & set(ids))
    assert b.gave_up is None and b.row_errors() == {"r1": BOOM, "r5": BOOM, "r9": BOOM}


def test_a_part_that_cannot_run_ends_the_bisection_once():
    b = Bisection(SimpleNamespace(shard=shard(8), errors=[BOOM]))
    first, second = b.start()
    b.abandon("actor died: killed")
    assert b.settled and b.gave_up == "bisection stopped: a part of the shard could not run: actor died: killed"
    assert b.part_failed(first, BOOM) == [] and b.part_ran(second, pa.table({"status": ["ok"]})) == []


@pytest.mark.parametrize("errors, attempt, died, n, expected", [
    ([BOOM, BOOM], 2, False, 12, True),              # the same error twice: bisect now, the third attempt spared
    (["RuntimeError: a", BOOM], 2, False, 12, False),  # different errors, attempts left: try again
    (["RuntimeError: a", BOOM], 3, False, 12, True),   # no attempt left
    (["actor died: x", "actor died: x"], 2, True, 12, False),  # an actor's death is never bisected
    (["actor died: x", BOOM, "actor died: x"], 3, True, 12, False),
    ([BOOM, BOOM], 2, False, 1, False),             # a single row: nothing to bisect
])
def test_when_a_shard_is_bisected(errors, attempt, died, n, expected):
    job = SimpleNamespace(shard=shard(n), errors=errors, attempt=attempt, piece=None)
    assert should_bisect(job, died, max_attempts=3) is expected


@pytest.mark.parametrize("policy, errors, over", [
    (True, 1, True), (False, 12, False), (0.2, 2, False), (0.2, 3, True),
])
def test_fail_on_error_judges_a_bisected_shard_as_an_actor_judges_its_batch(policy, errors, over):
    """Out of the rows sent to the engine (not skipped rows, nor those planning made error rows)."""
    from cluster.contracts.shard import EMPTY_PROMPT

    n = 12
    table = pa.table({"sample_id": [f"r{i}" for i in range(n + 2)],
                      "status": ["error"] * errors + ["ok"] * (n - errors) + ["skipped", "error"],
                      "error": [BOOM] * errors + [None] * (n - errors) + [None, EMPTY_PROMPT]})
    message = row_error_excess(SimpleNamespace(fail_on_error=policy), table)
    assert (message is not None) is over
    if over:
        assert message.startswith(f"{errors} of {n} rows failed, more than fail_on_error={policy} allows; "
                                  f"first: sample r0: {BOOM}.")


def test_a_failure_that_does_not_repeat_on_the_parts_leaves_no_error_row():
    b, parts = bisect(12, lambda ids: len(ids) == 12)  # e.g. a batch too large for the engine: halves run
    assert b.gave_up is None and not b.row_errors() and parts == 2
    assert b.table()["status"].to_pylist() == ["ok"] * 12


def test_a_sample_that_fails_alone_has_an_error_row_per_completion_and_fail_on_error_counts_them():
    """sampling.n = 4: the rows that ran are 4 per sample, so a sample that failed alone has 4 error rows (the
    results' grain, one row per completion), and fail_on_error: 0.25 judges 8 of 16 completions as the
    actor would, not 2 of 10 (otherwise a sweep with half its prompts failed would exit 0)."""
    schema = RESULTS.append(pa.field("completion", pa.int32()))
    task = SimpleNamespace(sampling=SimpleNamespace(n=4), type="generate", fail_on_error=0.25)
    b = Bisection(SimpleNamespace(shard=shard(4), errors=[BOOM, BOOM], task=task))
    queue = deque(b.start())
    while queue and not b.settled:
        piece = queue.popleft()
        ids = piece.shard.rows["sample_id"].to_pylist()
        if {"r1", "r2"} & set(ids):
            queue.extend(b.part_failed(piece, BOOM))
        else:
            rows = [{"sample_id": i, "output_text": "x", "status": "ok", "error": None, "completion": c}
                    for i in ids for c in range(4)]
            queue.extend(b.part_ran(piece, pa.Table.from_pylist(rows, schema=schema)))
    table = b.table()
    assert [(r["sample_id"], r["completion"], r["status"]) for r in table.to_pylist()] == [
        (f"r{i}", c, "error" if i in (1, 2) else "ok") for i in range(4) for c in range(4)]
    assert row_error_excess(task, table).startswith("8 of 16 rows failed, more than fail_on_error=0.25 allows")
