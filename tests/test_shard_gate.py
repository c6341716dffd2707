"""ShardGate (actors/shard_gate.py): the order in which a pool replica runs the shards waiting at it, with
asyncio and no Ray: round robin between sweeps, the awake model first, switches only when the engine is
idle, and no model waits for ever."""

import asyncio

import pytest

from actors.shard_gate import ShardGate


class Replica:
    """Shards as coroutines through a gate; the order they ran in, and the switches made."""

    def __init__(self, slots: int, awake: str = "a", quantum: int = 16):
        self.order: list[tuple[str, str]] = []
        self.switches: list[str] = []
        self.running: set[str] = set()
        self.gate = ShardGate(slots, awake, self._switch, quantum)

    async def _switch(self, model: str) -> dict:
        assert not self.running, "a switch while shards run"
        await asyncio.sleep(0.01)
        self.switches.append(model)
        return {"model": model}

    async def shard(self, sweep: str, model: str = "a", seconds: float = 0.01):
        admission = await self.gate.enter(sweep, model)
        try:
            assert model == self.gate.awake and not self.running - {model}
            self.running.add(model)
            self.order.append((sweep, model))
            await asyncio.sleep(seconds)
        finally:
            self.running.discard(model)
            self.gate.leave()
        return admission


async def _queue(replica: Replica, jobs: list[tuple[str, str]]):
    tasks = []
    for sweep, model in jobs:  # arrival order: one event-loop turn apart
        tasks.append(asyncio.ensure_future(replica.shard(sweep, model)))
        await asyncio.sleep(0)
    return await asyncio.gather(*tasks)


def test_a_sweep_that_arrives_behind_a_long_one_gets_every_other_turn():
    replica = Replica(slots=1)
    asyncio.run(_queue(replica, [("long", "a")] * 8 + [("short", "a")] * 3))
    sweeps = [s for s, _ in replica.order]
    # first come first served would run the long sweep's 8 first
    assert sweeps[:7] == ["long", "short", "long", "short", "long", "short", "long"]
    assert sorted(sweeps) == sorted(["long"] * 8 + ["short"] * 3)


def test_round_robin_over_three_sweeps_with_two_slots():
    replica = Replica(slots=2)
    asyncio.run(_queue(replica, [("x", "a")] * 4 + [("y", "a")] * 4 + [("z", "a")] * 4))
    sweeps = [s for s, _ in replica.order]
    assert sweeps[:2] == ["x", "x"]  # x took both free slots before y and z came
    assert set(sweeps[2:4]) == {"y", "z"} and sweeps[4] == "x"
    assert sweeps[4:7] == sweeps[1:4] and sweeps[7:10] == sweeps[1:4]  # then in turn: x, y, z, x, ...


def test_the_awake_model_goes_first_and_switches_wait_for_an_idle_engine():
    replica = Replica(slots=2, awake="b")
    jobs = [("s", "a"), ("s", "b"), ("s", "a"), ("s", "b"), ("s", "a"), ("s", "b")]
    admissions = asyncio.run(_queue(replica, jobs))
    assert [m for _, m in replica.order] == ["a", "a", "a", "b", "b", "b"]  # b's turn came with a's queue empty
    assert replica.switches == ["a", "b"]  # the first shard found model a asleep; one switch back to b
    switched = [a.switch for a in admissions if a.switch]
    assert switched == [{"model": "a"}, {"model": "b"}]  # each switch reported once, by the shard that caused it
    assert sorted(a.sequence for a in admissions) == list(range(1, 7))


def test_a_busy_awake_model_yields_after_its_quantum():
    replica = Replica(slots=1, awake="a", quantum=3)

    async def scenario():
        busy = [asyncio.ensure_future(replica.shard("s1", "a")) for _ in range(10)]
        await asyncio.sleep(0)
        other = asyncio.ensure_future(replica.shard("s2", "b"))
        await asyncio.gather(*busy, other)

    asyncio.run(scenario())
    models = [m for _, m in replica.order]
    assert models.index("b") <= 4  # the first a, then its quantum of 3 while b waited, then b
    assert replica.switches == ["b", "a"]


def test_a_cancelled_waiter_gives_its_place_up():
    replica = Replica(slots=1)

    async def scenario():
        first = asyncio.ensure_future(replica.shard("s", "a", seconds=0.05))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(replica.shard("s", "a"))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await first
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await replica.shard("s", "a")
        assert replica.gate.running == 0 and replica.gate.queued() == 0

    asyncio.run(scenario())
    assert len(replica.order) == 2


def test_after_a_failed_switch_no_shard_runs_on_the_engine_left_awake():
    replica = Replica(slots=1, awake="a")

    async def broken(model: str) -> dict:
        raise RuntimeError(f"wake_up of {model} failed")

    replica.gate._switch = broken

    async def scenario():
        shards = [asyncio.ensure_future(replica.shard("s", "b")) for _ in range(3)]
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(replica.shard("s", "b"))  # admitted after the switch had failed
        return await asyncio.gather(*shards, late, return_exceptions=True)

    results = asyncio.run(scenario())
    assert [str(r) for r in results] == ["wake_up of b failed"] * 4
    assert replica.order == [] and replica.gate.running == 0
