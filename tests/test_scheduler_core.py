"""The scheduler without Ray (cluster/schedule/scheduler.py and fleet.py over tests/scheduler_fakes.py's stand-in
I/O): what it decides on each answer. A shard that raises once is retried; one that raises the same way is
bisected down to its bad row; a model's last shard is cut at the tail; a lost node takes its actors and their
shards go elsewhere; an engine that raises or never answers fails its model, not the others; engines lent to the
sweep run their model's shards, and when they go away the model gets actors of its own. The same paths through
Ray and real actors: tests/test_scheduler.py, tests/test_reliability.py, tests/test_multinode.py."""

from types import SimpleNamespace

import pyarrow as pa
import pytest

from cluster.contracts.shard import ActorState, SHORT, Shard
from cluster.schedule.scheduler import SweepScheduler
from cluster.schedule.work import Job, ModelWork, SchedulerEvents, Slot, advance
from tests.scheduler_fakes import ActorLost, Answered, CallRaised, EnginesGone, FakeHandle, FakeIO

NODE_A, NODE_B = "a" * 56, "b" * 56


def shard(model: str, index: int, ids: list[str]) -> Shard:
    return Shard(f"{model}/t/{index:05d}", index, model, "t", SHORT, None, True, 0, pa.table({"sample_id": ids}))


def answer(shard_: Shard) -> Answered:
    ids = shard_.rows["sample_id"].to_pylist()
    table = pa.table({"sample_id": ids, "output_text": [f"out {i}" for i in ids], "status": ["ok"] * len(ids),
                      "error": pa.array([None] * len(ids), pa.string())})
    return Answered((table, {"shard_id": shard_.shard_id}))


def run(io: FakeIO, jobs: list[Job], models=("m",), actors: int = 2, split: bool = False, bisect: bool = False,
        lent: dict | None = None, families: dict | None = None):
    """The sweep of `jobs` to its end; what it reported. `families`: {model: its checkpoint family}."""
    seen = SimpleNamespace(results=[], failed=[], bisected=[], split=[], attempts=[], lost=[], model_failed=[])
    events = SchedulerEvents(
        on_result=lambda job, table, row: seen.results.append((job.shard.shard_id, table["sample_id"].to_pylist())),
        on_failed=lambda job: seen.failed.append((job.shard.shard_id, job.errors[-1])),
        on_bisected=(lambda job, table, errors: seen.bisected.append((job.shard.shard_id, table, errors)))
        if bisect else None,
        on_split=(lambda job, table: seen.split.append((job.shard.shard_id, table))) if split else None,
        on_attempt_failed=lambda job, error: seen.attempts.append((job.shard.shard_id, job.attempt, error)),
        on_actor_lost=seen.lost.append,
        on_model_failed=lambda model, error: seen.model_failed.append((model, error)))
    scheduler = SweepScheduler(io.spawn, events, capacity=actors, io=io)
    for name in models:
        scheduler.add_model(ModelWork(name, max_actors=actors, depth=1,
                                      start=lambda at, name=name: (name, at), family=(families or {}).get(name)))
    for name, handle in (lent or {}).items():  # engines up before the sweep (cluster/schedule/engine_sources.py)
        scheduler.fleet.lend(name, handle, depth=2, replicas=2)
    fed = []

    def feed(timeout_s: float) -> bool:
        if not fed:
            fed.append(True)
            scheduler.add_jobs(jobs)
        return True

    scheduler.run(feed)
    seen.scheduler = scheduler
    return seen


def script(ready=None, start=None, shard_=None):
    """A FakeIO script from three answers: to `ready` (default: up on node A), to `start_engine` (default: up),
    to `run_shard` (default: its rows' results)."""
    def answer_call(handle, method, args):
        if method == "ready":
            return (ready or (lambda h: Answered({"node_id": NODE_A, "node_ip": "10.0.0.1"})))(handle)
        if method == "start_engine":
            return (start or (lambda h, model: Answered({"model": model})))(handle, args[0])
        if method == "run_shard":
            return (shard_ or (lambda h, s, attempt: answer(s)))(handle, args[0], args[2])
        raise AssertionError(method)
    return answer_call


def jobs_of(model: str, n_shards: int, rows: int = 4) -> list[Job]:
    return [Job(shard(model, k, [f"{model}{k}-r{i}" for i in range(rows)]), task=None) for k in range(n_shards)]


def test_a_shard_that_raises_once_is_retried_and_answers():
    raised = set()

    def flaky(handle, s, attempt):
        if s.index == 1 and s.shard_id not in raised:
            raised.add(s.shard_id)
            return CallRaised(RuntimeError("CUDA hiccup"), RuntimeError("wrapped"))
        return answer(s)

    seen = run(FakeIO(script(shard_=flaky)), jobs_of("m", 3))
    assert sorted(r[0] for r in seen.results) == ["m/t/00000", "m/t/00001", "m/t/00002"] and not seen.failed
    assert seen.attempts == [("m/t/00001", 1, "RuntimeError: CUDA hiccup")]


def test_a_shard_that_raises_the_same_way_is_bisected_down_to_its_bad_row():
    def bad_row(handle, s, attempt):
        if "m0-r5" in s.rows["sample_id"].to_pylist():
            return CallRaised(ValueError("row 5 breaks the engine"), RuntimeError("wrapped"))
        return answer(s)

    seen = run(FakeIO(script(shard_=bad_row)), jobs_of("m", 1, rows=8), bisect=True)
    assert not seen.failed and len(seen.bisected) == 1  # reported once, as the whole shard
    shard_id, table, errors = seen.bisected[0]
    assert table["sample_id"].to_pylist() == [f"m0-r{i}" for i in range(8)]  # its order, each row once
    assert errors == {"m0-r5": "ValueError: row 5 breaks the engine"}
    assert table["status"].to_pylist() == ["ok"] * 5 + ["error"] + ["ok"] * 2
    assert [a[1] for a in seen.attempts[:2]] == [1, 2]  # the same error twice, then parts


def test_a_shard_that_raises_every_time_fails_after_its_attempts():
    seen = run(FakeIO(script(shard_=lambda h, s, attempt: CallRaised(RuntimeError(f"no {attempt}"), RuntimeError()))),
               jobs_of("m", 1))
    assert seen.failed == [("m/t/00000", "RuntimeError: no 3")] and [a[1] for a in seen.attempts] == [1, 2, 3]


def test_a_models_last_shard_is_cut_at_the_tail_and_reported_whole():
    """Two shards for two actors: once the first actor takes the small one, the large one alone waits where the
    actors hold two: it is cut (halves of 16 rows or more), and reported whole, once."""
    small, large = jobs_of("m", 1, rows=4)[0], Job(shard("m", 1, [f"m1-r{i}" for i in range(64)]), task=None)
    seen = run(FakeIO(script()), [small, large], split=True)
    assert seen.scheduler.tail_splits >= 1 and len(seen.split) == 1
    shard_id, table = seen.split[0]
    assert shard_id == "m/t/00001" and table["sample_id"].to_pylist() == [f"m1-r{i}" for i in range(64)]
    assert sum(r[0] == "m/t/00001" for r in seen.results) >= 2  # it ran in parts


def test_a_lost_node_takes_its_actors_and_their_shards_go_to_the_others():
    """Actors 0 and 1 on node A, 2 on node B; node A dies under actor 0's first shard: one line, both of A's
    actors out, and every shard answered once, by the actors left."""
    def ready(handle):
        node = NODE_A if handle.number < 2 else NODE_B
        return Answered({"node_id": node, "node_ip": "10.0.0.1" if node == NODE_A else "10.0.0.2"})

    died = []

    def shard_(handle, s, attempt):
        if handle.number == 0 and not died:
            died.append(s.shard_id)
            return ActorLost(RuntimeError(f"The actor died unexpectedly.\n\tip: 10.0.0.1\nThe actor died because its "
                                          f"node has died. Node Id: {NODE_A}\n"))
        return answer(s)

    io = FakeIO(script(ready=ready, shard_=shard_))
    seen = run(io, jobs_of("m", 6), actors=3)
    assert len(seen.lost) == 1 and seen.lost[0].startswith(f"[raysweep] node 10.0.0.1 ({NODE_A[:8]}) lost: actor(s) 0, 1 gone")
    assert sorted(r[0] for r in seen.results) == [f"m/t/{k:05d}" for k in range(6)] and not seen.failed
    assert io.handles[0].killed and io.handles[1].killed and seen.scheduler.fleet.nodes_lost == {NODE_A}


def test_an_engine_that_raises_fails_its_model_and_not_the_others():
    def start(handle, model):
        return CallRaised(OSError("no weights in ./broken"), RuntimeError()) if model == "broken" else \
            Answered({"model": model})

    seen = run(FakeIO(script(start=start)), jobs_of("ok", 3) + jobs_of("broken", 2), models=("ok", "broken"))
    assert seen.model_failed == [("broken", "engine did not start: OSError: no weights in ./broken")]
    assert sorted(seen.failed) == [("broken/t/00000", seen.model_failed[0][1]), ("broken/t/00001", seen.model_failed[0][1])]
    assert sorted(r[0] for r in seen.results) == ["ok/t/00000", "ok/t/00001", "ok/t/00002"]


def test_an_engine_start_that_never_answers_is_stopped_and_fails_its_model(monkeypatch):
    monkeypatch.setenv("RAYSWEEP_ENGINE_START_TIMEOUT_S", "0.05")
    io = FakeIO(script(start=lambda handle, model: None))  # a start that hangs
    seen = run(io, jobs_of("m", 2), actors=1)
    assert seen.model_failed and seen.model_failed[0][1].startswith("engine did not start within 0.05 s")
    assert len(seen.failed) == 2 and io.handles[0].killed


def test_a_slot_moves_only_along_the_scheduler_s_transitions():
    slot = Slot(handle=None, number=7)
    for state in (ActorState.IDLE, ActorState.STARTING, ActorState.RUNNING, ActorState.STARTING, ActorState.IDLE):
        advance(slot, state)
    with pytest.raises(AssertionError, match="actor slot 7: idle -> running is not a transition"):
        advance(slot, ActorState.RUNNING)


def test_engines_lent_to_the_sweep_run_its_shards_and_a_replica_s_death_is_retried_not_bisected():
    """No actor of the sweep's starts for a lent model; a shard whose engine died behind the lent handle (a pool
    replica's) is retried there as on an actor's death, even where failures are bisected."""
    died = []

    def shard_(handle, s, attempt):
        if not died:
            died.append(s.shard_id)
            return CallRaised(RuntimeError("ReplicaDied: replica 3 of models-m died"), RuntimeError(), died=True)
        return answer(s)

    io = FakeIO(script(shard_=shard_))
    lent = FakeHandle(io, 99)
    seen = run(io, jobs_of("m", 4), bisect=True, lent={"m": lent})
    assert io.handles == [] and not lent.closed and not lent.killed  # no actor started; the lender's left alone
    assert sorted(r[0] for r in seen.results) == [f"m/t/{k:05d}" for k in range(4)] and not seen.bisected
    assert seen.attempts == [(died[0], 1, "RuntimeError: ReplicaDied: replica 3 of models-m died")]


def test_lent_engines_that_go_away_give_their_model_actors_of_its_own_and_no_attempt_is_counted():
    def shard_(handle, s, attempt):
        return EnginesGone(RuntimeError("the engine pool is gone")) if handle.number == 99 else answer(s)

    io = FakeIO(script(shard_=shard_))
    seen = run(io, jobs_of("m", 3), lent={"m": FakeHandle(io, 99)})
    assert len(io.handles) == 2  # the model's own actors, as many as its maximum
    assert sorted(r[0] for r in seen.results) == [f"m/t/{k:05d}" for k in range(3)]
    assert seen.attempts == [] and not seen.failed and seen.scheduler.fleet.lent_lost == ["m"]
    assert all(handle.closed and handle.killed for handle in io.handles)  # the sweep's own actors released


def test_the_scheduler_and_its_fleet_decide_calls_and_only_the_io_makes_them():
    """Every call to an actor (its process up, an engine started, a shard run) is a `Call` the scheduler or the
    fleet returns and the I/O sends: in this sweep, READY then START per actor, then one SHARD per shard, each
    with the arguments the actor method takes; no `.remote(` is written in the deciding files."""
    import ast
    from pathlib import Path

    seen = run(FakeIO(script()), jobs_of("m", 3), actors=1)
    io = seen.scheduler.io
    assert [ref.method for ref in io.calls] == ["ready", "start_engine", "run_shard", "run_shard", "run_shard"]
    assert io.calls[1].args[0] == "m"  # start_engine(model, ..., requested_at)
    assert [(ref.args[0].shard_id, ref.args[2]) for ref in io.calls[2:]] == [  # run_shard(shard, task, attempt)
        ("m/t/00000", 1), ("m/t/00001", 1), ("m/t/00002", 1)]
    assert sorted(shard_id for shard_id, _ in seen.results) == ["m/t/00000", "m/t/00001", "m/t/00002"]
    schedule = Path(__file__).parents[1] / "cluster" / "schedule"
    for name in ("scheduler.py", "fleet.py", "work.py", "bisection.py", "tail_split.py"):
        remote = [node.lineno for node in ast.walk(ast.parse((schedule / name).read_text()))
                  if isinstance(node, ast.Attribute) and node.attr == "remote"]
        assert remote == [], f"{name}: a remote call at lines {remote}"


def test_a_model_is_checking_until_it_may_start_and_failed_once_given_up():
    """A model's state, as an enum: CHECKING while its checks run (its actors may start, no engine), READY once
    its engine start is known, FAILED with the engine's error once no engine of it could start."""
    from cluster.schedule.work import ModelState

    model = ModelWork("m", max_actors=1, depth=1)
    assert model.state is ModelState.CHECKING and not model.failed
    model.start = lambda at: ("m", at)
    assert model.state is ModelState.READY
    model.give_up("engine did not start: OOM")
    assert model.state is ModelState.FAILED and model.failed and model.error == "engine did not start: OOM"


def test_an_actor_whose_model_is_done_takes_another_checkpoint_of_it_first_where_the_work_is_even():
    """a1 and a2 are checkpoints of one model, b1 of another, each with as much work: the one actor runs a1, then
    a2 (its engine loads the weights alone: actors/weight_swap.py), then b1, not in the order they were given."""
    io = FakeIO(script())
    seen = run(io, jobs_of("a1", 2) + jobs_of("b1", 2) + jobs_of("a2", 2), models=("a1", "b1", "a2"), actors=1,
               families={"a1": "family a", "a2": "family a", "b1": "family b"})
    assert [ref.args[0] for ref in io.calls if ref.method == "start_engine"] == ["a1", "a2", "b1"]
    assert len(seen.results) == 6 and not seen.failed
