"""Profile routing: long shards go to actors running the long profile, short ones to short, so a mixed
sweep restarts each actor's engine at most once per profile change (the fake engine, like vLLM,
restarts for another profile; the CPU engine never needs to)."""

import json

import pyarrow.parquet as pq
import pytest
import yaml

from cluster.schedule.run import run_sweep
from cluster.inputs.spec_file import load_spec


@pytest.mark.slow
def test_mixed_profiles_route_with_few_restarts(engine_host, ray_local, tmp_path):
    rows = [{"id": f"s{i}", "text": f"sample {i}"} for i in range(60)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # submission order alternates short, long, short, long: first-come-first-served would restart often
    tasks = [{"name": f"t{k}", "data": "d.jsonl", "id_column": "id", "prompt": "{text}",
              "chunked_prefill": "on" if k % 2 else "off", "sampling": {"max_tokens": 2}} for k in range(4)]
    (tmp_path / "mixed.yaml").write_text(yaml.safe_dump({
        "name": "routing", "output": str(tmp_path / "out"), "models": [{"name": "m", "path": "builtin:tiny",
                                                                       "engine": "fake"}],
        "tasks": tasks, "shards": {"max_samples": 10}, "actors": {"count": 2, "num_cpus": 1}}))
    spec = load_spec(tmp_path / "mixed.yaml")
    report = run_sweep(spec, engine_host=engine_host, log=lambda line: None)
    assert not report.failed and report.samples == 240
    shards = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pandas()
    # 24 shards; a long one cut at the tail (cluster/schedule/tail_split.py) has a telemetry row per part
    assert set(shards["profile"]) == {"short", "long"} and shards["shard_id"].nunique() == 24
    parts = shards["piece"].notna() if "piece" in shards else shards["shard_id"].isna()  # no column: no part
    assert len(shards[~parts]) + shards[parts]["shard_id"].nunique() == 24
    starts = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    restarts = starts[starts["restart"] > 0]
    # two profiles, two actors: each actor takes one profile and keeps it; a restart is only allowed
    # when an actor runs out of its own profile's shards (at most one change per actor)
    assert len(restarts) <= 2, starts[["actor_id", "profile", "restart"]]
    per_actor = shards.groupby("actor_id")["profile"].apply(
        lambda p: int((p.reset_index(drop=True) != p.reset_index(drop=True).shift()).sum() - 1))
    assert (per_actor <= 1).all(), per_actor


@pytest.mark.slow
def test_an_actor_ray_cannot_place_holds_no_shards(engine_host, ray_local, tmp_path):
    """Three actors of 1 CPU on a 2-CPU Ray: the third never starts, and the sweep must not wait on it."""
    rows = [{"id": f"s{i}", "text": f"sample {i}"} for i in range(50)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "name": "unplaceable", "output": str(tmp_path / "out"),
        "models": [{"name": "m", "path": "builtin:tiny", "engine": "fake"}],
        "tasks": [{"name": "t", "data": "d.jsonl", "id_column": "id", "prompt": "{text}", "sampling": {"max_tokens": 2}}],
        "shards": {"max_samples": 5}, "actors": {"count": 3, "num_cpus": 1}}))
    report = run_sweep(load_spec(tmp_path / "s.yaml"), engine_host=engine_host, log=lambda line: None)
    assert not report.failed and report.samples == 50
    shards = pq.read_table(tmp_path / "out" / "telemetry" / "shards.parquet").to_pandas()
    assert 1 <= shards["actor_id"].nunique() <= 2  # the fake engine is instant: one actor may do it all
    starts = pq.read_table(tmp_path / "out" / "telemetry" / "actors.parquet").to_pandas()
    assert len(starts) <= 2  # the third actor never started


def _scheduler(ray_local, broken_engine: bool, results: list, one_by_one: bool = False):
    from types import SimpleNamespace

    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    # defined here so Ray ships the class by value (workers cannot import this test module)
    class _StartsThenServes:
        """A stand-in actor with the scheduler's interface: number 0 dies while importing (as a process
        killed or out of memory would); model "broken"'s engine raises as it starts (as an engine that
        cannot load its weights does)."""

        def __init__(self, number: int):
            self.number = number

        def ready(self) -> dict:
            if self.number == 0:
                import os

                os._exit(1)
            return {}

        def start_engine(self, model: str, requested_at: float) -> dict:
            if model == "broken":
                raise RuntimeError("model weights not found")
            self.model = model
            return {"actor": self.number, "model": model}

        def run_shard(self, shard, task, attempt):
            import time

            time.sleep(0.3)  # long enough that the sweep is still running when actor 0's death is seen
            return (self.model, shard.name), {"actor": self.number}

        def close(self) -> None:
            pass

    remote = ray_local.remote(_StartsThenServes).options(num_cpus=0.1, max_restarts=0)
    events = SchedulerEvents(on_result=lambda job, value, telemetry: results.append(value),
                             on_failed=lambda job: results.append(("failed", job.shard.name, job.errors[-1])))
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(n), events, capacity=2, start_one_by_one=one_by_one)
    models = ["good", "broken"] if broken_engine else ["good"]
    for name in models:
        scheduler.add_model(ModelWork(name, max_actors=1 if broken_engine else 2, depth=2,
                                      start=lambda at, name=name: (name, at)))
    jobs = [Job(SimpleNamespace(name=f"{m}{i}", model=m, profile="short", n_samples=1), None)
            for m in models for i in range(6)]
    return scheduler, jobs


def _one_model_on_two_actors(ray_local, actor_class, shards: int, depth: int, prefix: str) -> list:
    """Model "m"'s `shards` one-sample shards (named prefix + i) on up to two actors of `actor_class`, `depth`
    deep: the scheduler, and what each shard returned, or ("failed", errors)."""
    from types import SimpleNamespace

    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    remote = ray_local.remote(actor_class).options(num_cpus=0.1, max_restarts=0)
    results = []
    events = SchedulerEvents(on_result=lambda job, value, telemetry: results.append(value),
                             on_failed=lambda job: results.append(("failed", job.errors)))
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(n), events, capacity=2)
    scheduler.add_model(ModelWork("m", max_actors=2, depth=depth,
                                  start=lambda at: ("m", at)))
    jobs = [Job(SimpleNamespace(name=f"{prefix}{i}", model="m", profile="short", n_samples=1), None)
            for i in range(shards)]
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    return scheduler, results


def _feed_all(scheduler, jobs):
    def feed(timeout_s: float) -> bool:
        scheduler.add_jobs(jobs)
        return True
    return feed


@pytest.mark.parametrize("one_by_one", [False, True])  # True: engines sharing a GPU start one at a time
@pytest.mark.slow
def test_an_actor_that_dies_while_starting_is_replaced(ray_local, one_by_one):
    results = []
    scheduler, jobs = _scheduler(ray_local, broken_engine=False, results=results, one_by_one=one_by_one)
    scheduler.run(_feed_all(scheduler, jobs))
    assert sorted(results) == [("good", f"good{i}") for i in range(6)]  # every shard once, none failed
    assert scheduler.fleet.actors_started == 3 and scheduler.fleet.actor_deaths == 1


@pytest.mark.parametrize("one_by_one", [False, True])
@pytest.mark.slow
def test_an_engine_that_cannot_start_fails_its_model_only(ray_local, one_by_one):
    results = []
    scheduler, jobs = _scheduler(ray_local, broken_engine=True, results=results, one_by_one=one_by_one)
    scheduler.run(_feed_all(scheduler, jobs))
    failed = sorted(r for r in results if r[0] == "failed")
    assert [r[1] for r in failed] == [f"broken{i}" for i in range(6)]
    assert all("engine did not start" in r[2] and "model weights not found" in r[2] for r in failed)
    assert sorted(r for r in results if r[0] != "failed") == [("good", f"good{i}") for i in range(6)]


@pytest.mark.parametrize("max_samples, engine, actors, depth", [
    (256, {}, {}, 4),                          # 4 x 256 queued for a batch of 256
    (512, {}, {}, 2),                          # never fewer than two
    (32, {}, {}, 8),                           # never more than eight by default
    (64, {"max_num_seqs": 64}, {}, 4),
    (256, {}, {"shards_in_flight": 12}, 12),   # the spec decides where it says
])
def test_shards_in_flight_fill_four_engine_batches(max_samples, engine, actors, depth):
    from cluster.plan.depth import shards_in_flight
    from cluster.inputs.spec_file import parse_spec

    spec = parse_spec({"name": "d", "models": [{"name": "m", "path": "builtin:tiny", "engine": engine}],
                       "tasks": [{"name": "t", "data": "x.jsonl", "prompt": "{q}"}],
                       "shards": {"max_samples": max_samples}, "actors": actors})
    assert shards_in_flight(spec, spec.models[0]) == depth


@pytest.mark.parametrize("rows, actors, depth", [
    (10496, 16, 2),  # 43 shards of 256 for 16 engines: two each, the rest wait (four each would hold them all)
    (10496, 8, 3),
    (10496, 4, 4),   # one GPU's four engines: the batch rule's four
    (100, 2, 2),     # never fewer than two
    (1312, 1, 4),    # one engine shares with nobody: the batch rule's four
])
def test_many_actors_for_few_rows_leave_half_the_shards_waiting(rows, actors, depth):
    from cluster.plan.depth import shards_in_flight
    from cluster.inputs.spec_file import parse_spec

    spec = parse_spec({"name": "d", "models": [{"name": "m", "path": "builtin:tiny"}],
                       "tasks": [{"name": "t", "data": "x.jsonl", "prompt": "{q}"}], "shards": {"max_samples": 256}})
    assert shards_in_flight(spec, spec.models[0], rows=rows, actors=actors) == depth


@pytest.mark.parametrize("engine, resources, accelerator, cpu", [
    ({}, {"CPU": 2}, None, True),                         # auto, no GPU: the CPU engine
    ({}, {"CPU": 2, "GPU": 1}, None, False),               # auto with a GPU: vLLM
    ({}, {"CPU": 2}, "L4", False),                         # GPUs asked of the autoscaler: vLLM
    ({"backend": "hf"}, {"CPU": 2, "GPU": 1}, None, True),
    ({"backend": "fake"}, {"CPU": 2}, None, False),
])
def test_a_cpu_engine_holds_two_shards_whatever_its_batch(engine, resources, accelerator, cpu):
    from cluster.plan.depth import runs_on_cpu, shards_in_flight
    from cluster.inputs.spec_file import parse_spec

    engine = {"max_num_seqs": 64, **engine}
    spec = parse_spec({"name": "d", "models": [{"name": "m", "path": "builtin:tiny", "engine": engine}],
                       "tasks": [{"name": "t", "data": "x.jsonl", "prompt": "{q}"}], "shards": {"max_samples": 16}})
    model = spec.models[0]
    assert runs_on_cpu(model, resources, accelerator) is cpu
    assert shards_in_flight(spec, model, runs_on_cpu(model, resources, accelerator)) == (2 if cpu else 8)


@pytest.mark.slow
def test_an_engine_that_fails_on_one_actor_of_a_running_model_fails_nothing(ray_local, tmp_path):
    """Actor 1's engine raises (as a GPU share short of memory would) while actor 0 runs the same model:
    actor 1 gives the model up, and actor 0 runs every shard. Gated, not timed: actor 1 raises once actor 0 has
    run a shard (the scheduler knows the model runs), and actor 0 runs its others once actor 1 has raised."""
    ran, failing = str(tmp_path / "actor-0-ran-a-shard"), str(tmp_path / "actor-1-fails")

    def wait_for(path: str) -> None:
        import os
        import time

        end = time.monotonic() + 60  # a bound only a hang reaches
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.02)

    class _SecondFails:
        def __init__(self, number: int):
            self.number, self.waited = number, False

        def ready(self) -> dict:
            return {}

        def start_engine(self, model: str, requested_at: float) -> dict:
            if self.number == 1:
                wait_for(ran)
                open(failing, "w").close()
                raise RuntimeError("CUDA out of memory")
            return {"actor": self.number}

        def run_shard(self, shard, task, attempt):
            import os
            import time

            if self.number == 0 and os.path.exists(ran) and not self.waited:
                self.waited = True  # once: a failure that never comes costs one bound, and the test fails below
                wait_for(failing)
            open(ran, "a").close()
            time.sleep(0.2)
            return shard.name, {"actor": self.number}

        def close(self) -> None:
            pass

    scheduler, results = _one_model_on_two_actors(ray_local, _SecondFails, shards=12, depth=2, prefix="s")
    assert (tmp_path / "actor-1-fails").exists(), "actor 1's engine never failed: the case was not run"
    assert sorted(results) == sorted(f"s{i}" for i in range(12))  # nothing failed
    assert not scheduler.models["m"].failed


@pytest.mark.slow
def test_on_a_shared_gpu_an_actor_is_released_only_once_no_engine_is_starting(ray_local, tmp_path):
    """Model a's only shard ends while model b's engine is still starting on the same GPU: a's actor closes
    its engine only after b's start returned, since vLLM's memory profiling fails when memory is freed
    under it."""
    from types import SimpleNamespace

    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    log = str(tmp_path / "events.log")

    class _Logged:
        def __init__(self, number: int):
            self.number = number

        def ready(self) -> dict:
            return {}

        def _log(self, line: str) -> None:
            import time

            with open(log, "a") as f:
                f.write(f"{time.time():.6f} {line}\n")

        def start_engine(self, model: str, requested_at: float) -> dict:
            import time

            self.model = model
            self._log(f"starting {model}")
            time.sleep(1.5 if model == "b" else 0.0)
            self._log(f"started {model}")
            return {"actor": self.number}

        def run_shard(self, shard, task, attempt):
            import time

            # a's shard ends only once b's engine is starting (else, where b's actor came up late on a busy
            # machine, a's idle actor took b's shards, a model change, and nothing was left to check)
            deadline = time.time() + 60
            while shard.model == "a" and "starting b" not in open(log).read() and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            return shard.name, {"actor": self.number}

        def close(self) -> None:
            self._log(f"closed {self.model}")

    remote = ray_local.remote(_Logged).options(num_cpus=0.1, max_restarts=0)
    results = []
    events = SchedulerEvents(on_result=lambda job, value, telemetry: results.append(value),
                             on_failed=lambda job: results.append(("failed", job.errors)))
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(n), events, capacity=2, start_one_by_one=True)
    for name in ("a", "b"):
        scheduler.add_model(ModelWork(name, max_actors=1, depth=2,
                                      start=lambda at, name=name: (name, at)))
    # a has the most samples left, so it starts first; b starts once a runs, and a's shard ends meanwhile; b's
    # two shards are what its actor holds at once, so a's actor has no tail of b's to help with: it is released
    jobs = [Job(SimpleNamespace(name="a0", model="a", profile="short", n_samples=100), None)] + \
        [Job(SimpleNamespace(name=f"b{i}", model="b", profile="short", n_samples=1), None) for i in range(2)]
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    assert sorted(results) == ["a0", "b0", "b1"]
    with open(log) as f:
        events_at = {line.split(" ", 1)[1].strip(): float(line.split(" ", 1)[0]) for line in f}
    assert events_at["started a"] < events_at["started b"] <= events_at["closed a"]


@pytest.mark.slow
def test_actors_no_model_needs_close_their_engines_at_once(ray_local, tmp_path):
    """A model's last two shards end on two actors: both engines are closed together, not one after the other
    (a vLLM engine's close takes about a second: seen at the end of every sweep on a GPU)."""
    log = str(tmp_path / "events.log")

    class _SlowClose:
        def __init__(self, number: int):
            self.number = number

        def _log(self, line: str) -> None:
            import time

            with open(log, "a") as f:
                f.write(f"{time.time():.6f} {line}\n")

        def ready(self) -> dict:
            return {}

        def start_engine(self, model: str, requested_at: float) -> dict:
            self._log(f"started {self.number}")
            return {"actor": self.number}

        def run_shard(self, shard, task, attempt):
            import time

            deadline = time.time() + 60  # both actors hold a shard (a busy machine may start one late)
            while open(log).read().count("started") < 2 and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            return shard.name, {"actor": self.number}

        def close(self) -> None:
            import time

            self._log(f"closing {self.number}")
            time.sleep(1.0)
            self._log(f"closed {self.number}")

    _, results = _one_model_on_two_actors(ray_local, _SlowClose, shards=2, depth=1, prefix="m")
    assert sorted(results) == ["m0", "m1"]
    with open(log) as f:
        events_at = {line.split(" ", 1)[1].strip(): float(line.split(" ", 1)[0]) for line in f}
    closing = [events_at[f"closing {n}"] for n in (0, 1)]
    closed = [events_at[f"closed {n}"] for n in (0, 1)]
    assert max(closing) < min(closed), events_at  # the second close began before the first ended


@pytest.mark.parametrize("broken", ["one row", "every row"])
@pytest.mark.slow
def test_a_shard_that_raises_the_same_way_is_bisected_and_reported_once(ray_local, broken):
    """A stand-in actor raises on any shard or part holding row r5 (or on every call): after two identical
    failures the shard is bisected; its parts run on the actors, and the shard is reported once, either
    with r5 as its only error row or, where no part ran, as failed whole. The other shard runs as usual."""
    import pyarrow as pa

    from cluster.contracts.shard import Shard
    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import Job, ModelWork, SchedulerEvents

    class _BreaksOnARow:
        def __init__(self, number: int):
            pass

        def ready(self) -> dict:
            return {}

        def start_engine(self, model: str, requested_at: float) -> dict:
            return {}

        def run_shard(self, shard, task, attempt):
            import pyarrow as pa

            ids = shard.rows["sample_id"].to_pylist()
            if task == "every row" or "r5" in ids:
                raise RuntimeError("boom")
            return pa.table({"sample_id": ids, "status": ["ok"] * len(ids),
                             "error": pa.array([None] * len(ids), pa.string())}), {"ids": ids}

        def close(self) -> None:
            pass

    remote = ray_local.remote(_BreaksOnARow).options(num_cpus=0.1, max_restarts=0)
    ran, bisected, failed, attempts = [], [], [], []
    events = SchedulerEvents(
        on_result=lambda job, table, telemetry: ran.append((job.piece is not None, telemetry["ids"])),
        on_failed=lambda job: failed.append((job.shard.shard_id, job.errors[-1])),
        on_attempt_failed=lambda job, error: attempts.append((job.piece is not None, error)),
        on_bisected=lambda job, table, errors: bisected.append((job.shard.shard_id, table, errors)))
    scheduler = SweepScheduler(lambda n, at, shape: remote.remote(n), events, capacity=2)
    scheduler.add_model(ModelWork("m", max_actors=2, depth=2,
                                  start=lambda at: ("m", at)))
    shards = [Shard(f"m/t/{k:05d}", k, "m", "t", "short", None, True, 0,
                    pa.table({"sample_id": [f"r{i}" if k == 0 else f"s{i}" for i in range(12)]})) for k in range(2)]
    jobs = [Job(shards[0], broken), Job(shards[1], "fine")]
    scheduler.run(lambda timeout_s: scheduler.add_jobs(jobs) or True)
    assert (False, [f"s{i}" for i in range(12)]) in ran  # the healthy shard, whole, once
    assert attempts[:2] == [(False, "RuntimeError: boom")] * 2  # two whole attempts, then only parts
    assert all(piece for piece, _ in attempts[2:])
    if broken == "one row":
        assert not failed and len(bisected) == 1
        shard_id, table, errors = bisected[0]
        assert shard_id == "m/t/00000" and errors == {"r5": "RuntimeError: boom"}
        assert table["sample_id"].to_pylist() == [f"r{i}" for i in range(12)]
        assert table["status"].to_pylist() == ["ok"] * 5 + ["error"] + ["ok"] * 6
        parts = sorted(i for piece, ids in ran if piece for i in ids)
        assert parts == sorted(f"r{i}" for i in range(12) if i != 5)  # every other row ran once, in parts
    else:
        assert not bisected and len(failed) == 1 and len(attempts) == 2 + 6
        assert failed[0][1].startswith("bisected into 6 parts, none of which ran")


def test_the_line_for_a_lost_node_or_actor():
    """cluster/schedule/work.py lost_node and lost_line: the driver's one line when actors die (tests/
    test_multinode.py loses a real node)."""
    from types import SimpleNamespace

    from ray.exceptions import ActorUnavailableError

    from cluster.schedule.work import lost_line, lost_node

    node = "a06e8ef9bb9672f90d4ec11819e0eb6e8d893a0cbb9c385536edafc8"
    held = [SimpleNamespace(attempt=1), SimpleNamespace(attempt=3), SimpleNamespace(attempt=2)]
    died = RuntimeError(f"The actor died unexpectedly.\n\tip: 10.0.0.7\nThe actor died because its node has died. "
                        f"Node Id: {node}\n\tthe actor's node was terminated unexpectedly: health check failed")
    assert lost_node(died, None) == (node, "10.0.0.7", "gone")
    assert lost_line([3, 1], lost_node(died, None), "", held, 3) == (
        "[raysweep] node 10.0.0.7 (a06e8ef9) lost: actor(s) 1, 3 gone, 2 shard(s) sent to other actors, "
        "1 failed at their last attempt")
    unreachable = ActorUnavailableError("RpcError: Socket closed", b"\x00" * 16)
    assert lost_node(unreachable, (node, "10.0.0.8"), unreachable=True) == (node, "10.0.0.8", "unreachable")
    assert lost_node(unreachable, None, unreachable=True) is None  # where it ran is not known: an actor's death
    crashed = RuntimeError("The actor is dead because its worker process has died.")
    assert lost_node(crashed, (node, "10.0.0.8")) is None
    assert lost_line([2], None, "ActorDiedError: worker died", held[:1], 3) == (
        "[raysweep] actor(s) 2 died (ActorDiedError: worker died): 1 shard(s) sent to other actors")


def test_actor_states_are_one_enum_and_the_progress_line_counts_them_by_name():
    from cluster.contracts.shard import ActorState
    from cluster.schedule.progress import state_counts
    from cluster.schedule.scheduler import SweepScheduler
    from cluster.schedule.work import SchedulerEvents, Slot

    scheduler = SweepScheduler(lambda n, at, shape: None, SchedulerEvents(on_result=None, on_failed=None), capacity=3)
    scheduler.fleet.slots = [Slot(None, 0), Slot(None, 1, state=ActorState.RUNNING), Slot(None, 2, state=ActorState.RUNNING)]
    assert scheduler.fleet.slots[0].state is ActorState.IMPORTING
    assert state_counts(scheduler.fleet.slots) == {"importing": 1, "running": 2}
    assert all(type(k) is str for k in state_counts(scheduler.fleet.slots))


def test_no_state_is_spelled_as_a_bare_string_in_the_schedule_stage():
    """An actor slot's state and what a call to it is for (cluster/contracts/shard.py ActorState, ActorCall), a
    row's status (RowStatus) and a sweep's state for the pool (cluster/contracts/pool_protocol.py SweepState)
    are their enums' members in cluster/schedule/, never string literals (docstrings aside), where they are
    compared, passed or stored as a status or state."""
    import ast
    from pathlib import Path

    from cluster.contracts.pool_protocol import SweepState
    from cluster.contracts.shard import ActorCall, ActorState, RowStatus

    everywhere = {s.value for enum in (ActorState, ActorCall) for s in enum}  # no other meaning in the stage
    as_state = everywhere | {s.value for enum in (RowStatus, SweepState) for s in enum}
    found = []
    for path in sorted((Path(__file__).parents[1] / "cluster" / "schedule").glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        stated = set()  # constants compared, passed as an argument, or stored under a "state" or "status" key
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                stated |= {id(c) for side in [node.left, *node.comparators] for c in ast.walk(side)}
            elif isinstance(node, ast.Call):
                stated |= {id(a) for a in node.args}
            elif isinstance(node, ast.Dict):
                stated |= {id(v) for k, v in zip(node.keys, node.values)
                           if isinstance(k, ast.Constant) and k.value in ("state", "status")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if node.value in everywhere or (node.value in as_state and id(node) in stated):
                    found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert found == []
