"""Actors Ray has not placed: told apart from importing ones in the progress line, said once in one line with what
they ask for and what the cluster has free, and said placed once they are (cluster/schedule/placement_wait.py).
No Ray here: the actor table, the cluster's room and the clock are stand-ins; tests/test_busy_cluster.py runs the
same on a real cluster whose CPU another job holds."""

from cluster.contracts.shard import ActorState
from cluster.plan.placement import ActorResources
from cluster.schedule.placement_wait import PlacementWatch, RayView, actor_name, waiting_line
from cluster.schedule.progress import Ticks, state_counts
from cluster.schedule.work import Slot

CPU1 = ActorResources(num_cpus=1.0, num_gpus=0.0, accelerator_type=None)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def demanded(unstarted: set[str] | None, demand: list | None = None):
    """A stand-in for Ray's view: `unstarted` actors, and a demand of one CPU each where none is given."""
    if unstarted is None:
        return lambda: None
    return lambda: RayView(unstarted, demand if demand is not None else [({"CPU": 1.0}, len(unstarted))])


def watch_of(unplaced: set[str] | None, lines: list[str], clock: Clock, pool: int = 0) -> PlacementWatch:
    return PlacementWatch("s", lines.append, view=demanded(unplaced), pool=lambda: pool, clock=clock,
                          room=lambda: ({"memory": 1e9}, {"CPU": 2.0, "memory": 1e9}))


def test_an_actor_left_unplaced_is_said_once_after_a_while_and_said_placed_once_it_is():
    lines, clock, pending = [], Clock(), {actor_name("s", 1)}
    slots = [Slot(None, 0, state=ActorState.RUNNING, shape=CPU1), Slot(None, 1, shape=CPU1)]
    watch = watch_of(pending, lines, clock)
    watch.look(slots)
    assert watch.waiting == {1} and lines == []  # seen waiting, not said yet
    assert state_counts(slots, watch.waiting) == {"running": 1, "waiting to be placed": 1}
    for now in (5, 10, 15, 20):
        clock.now = now
        watch.look(slots)
    assert lines == ["[raysweep] 1 actor(s) wait for Ray to place them: each asks for CPU 1; the cluster has CPU 0 "
                     "of 2 free: other work holds the rest, or no node has it. They start once it is freed or a node "
                     "is added (`ray status` shows the demand); the sweep waits"]
    pending.clear()  # placed: it imports now
    clock.now = 25
    watch.look(slots)
    assert watch.waiting == set() and lines[1:] == ["[raysweep] the 1 actor(s) that waited were placed after 25s"]
    assert state_counts(slots, watch.waiting) == {"running": 1, "importing": 1}


def test_a_short_wait_is_not_said_and_the_table_is_read_at_most_every_five_seconds():
    lines, clock, reads = [], Clock(), []
    slots = [Slot(None, 0, shape=CPU1)]

    def view():
        reads.append(clock.now)
        return RayView({actor_name("s", 0)}, [({"CPU": 1.0}, 1)]) if clock.now < 8 else RayView(set(), [])

    watch = PlacementWatch("s", lines.append, view=view, clock=clock,
                           room=lambda: ({}, {"CPU": 1.0}))
    for now in range(0, 20):
        clock.now = float(now)
        watch.look(slots)
    assert reads == [0.0, 5.0, 10.0, 15.0] and lines == [] and watch.waiting == set()


def test_what_holds_the_room_is_named_where_the_pool_has_replicas_and_actors_of_other_sweeps_are_not_ours():
    lines, clock = [], Clock()
    slots = [Slot(None, 0, shape=CPU1), Slot(None, 1, shape=CPU1)]
    watch = watch_of({actor_name("other", 0), actor_name("s", 0), actor_name("s", 1)}, lines, clock, pool=2)
    for now in (0, 10):
        clock.now = now
        watch.look(slots)
    assert watch.waiting == {0, 1}
    assert lines[0].startswith("[raysweep] 2 actor(s) wait for Ray to place them: each asks for CPU 1; the cluster has "
                               "CPU 0 of 2 free: other work holds the rest (the engine pool's 2 replica(s) hold theirs "
                               "until `raysweep pool down`), or no node has it. They start")


def test_an_unreadable_actor_table_says_nothing_and_counts_actors_importing():
    lines, clock = [], Clock()
    slots = [Slot(None, 0, shape=CPU1)]
    watch = watch_of(None, lines, clock)
    for now in (0, 10, 20):
        clock.now = now
        watch.look(slots)
    assert lines == [] and state_counts(slots, watch.waiting) == {"importing": 1}


def test_gpu_shapes_are_told_with_their_gpus_and_accelerator():
    gpu = ActorResources(num_cpus=1.0, num_gpus=0.5, accelerator_type=None)
    line = waiting_line([gpu.bundle(), gpu.bundle()], {"CPU": 3.0}, {"CPU": 4.0, "GPU": 1.0}, 0)
    assert "2 actor(s) wait" in line and "each asks for CPU 1, GPU 0.5;" in line
    assert "the cluster has CPU 3 of 4, GPU 0 of 1 free" in line
    l4 = ActorResources(num_cpus=1.0, num_gpus=1.0, accelerator_type="L4")
    line = waiting_line([l4.bundle()], {"CPU": 3.0}, {"CPU": 4.0}, 0)
    assert "each asks for CPU 1, GPU 1 on an L4 node; the cluster has CPU 3 of 4, GPU 0 of 0 free" in line


def test_an_actor_that_waited_and_left_the_fleet_is_not_said_placed_and_a_started_one_is_not_shown_waiting():
    lines, clock, unplaced = [], Clock(), {actor_name("s", 0), actor_name("s", 1)}
    slots = [Slot(None, 0, shape=CPU1), Slot(None, 1, shape=CPU1)]
    watch = watch_of(unplaced, lines, clock)
    for now in (0, 10):
        clock.now = now
        watch.look(slots)
    assert len(lines) == 1 and "2 actor(s) wait" in lines[0]
    slots[0].state = ActorState.RUNNING  # placed and started between two looks: no longer shown as waiting
    assert state_counts(slots, watch.waiting) == {"running": 1, "waiting to be placed": 1}
    unplaced.clear()
    del slots[1]  # the other was stopped (its node lost): it was not placed
    clock.now = 15
    watch.look(slots)
    assert lines[1:] == ["[raysweep] the 1 actor(s) that waited were placed after 15s"]


def test_a_cluster_that_does_not_say_its_room_delays_the_line_to_the_next_look():
    lines, clock, answers = [], Clock(), [RuntimeError("GCS busy")]

    def room():
        if answers:
            raise answers.pop()
        return {}, {"CPU": 1.0}

    watch = PlacementWatch("s", lines.append, view=demanded({actor_name("s", 0)}), room=room, clock=clock)
    for now in (0, 10, 15):
        clock.now = now
        watch.look([Slot(None, 0, shape=CPU1)])
        assert len(lines) == (now == 15)


def test_an_actor_whose_worker_process_is_starting_is_not_waiting_and_the_demand_bounds_how_many_are():
    """No worker process yet, but no demand of its shape: its resources are its own, its process starts (a loaded
    machine). Two unstarted and a demand of one: one waits."""
    lines, clock = [], Clock()
    slots = [Slot(None, 0, shape=CPU1), Slot(None, 1, shape=CPU1)]
    unstarted = {actor_name("s", 0), actor_name("s", 1)}
    gpu_demand = PlacementWatch("s", lines.append, view=demanded(unstarted, [({"CPU": 1.0, "GPU": 1.0}, 2)]),
                                clock=clock)
    gpu_demand.look(slots)
    assert gpu_demand.waiting == set()
    one = PlacementWatch("s", lines.append, view=demanded(unstarted, [({"CPU": 1.0}, 1)]), clock=clock)
    one.look(slots)
    assert one.waiting == {0}


def test_the_progress_line_says_which_actors_wait_to_be_placed():
    told = []

    class Progress:
        def tick(self, doing: str) -> None:
            told.append(doing)

    clock = Clock()
    watch = watch_of({actor_name("s", 0)}, [], clock)
    Ticks(Progress(), watch).tick([Slot(None, 0, shape=CPU1), Slot(None, 1, shape=CPU1)], 0, True)
    assert told == ["1 actor(s) importing, 1 actor(s) waiting to be placed; 0 shard(s) in flight; planning"]


def test_the_pools_replicas_are_counted_without_its_ingress(monkeypatch):
    """The ingress holds no CPU: the line counted it among the replicas holding the cluster's room."""
    import ray

    from cluster.pool.served import pool_replicas

    names = ["SERVE_REPLICA::raysweep-pool#ingress#a1", "SERVE_REPLICA::raysweep-pool#tiny#b2",
             "SERVE_REPLICA::other-app#tiny#c3", "SERVE_CONTROLLER_ACTOR"]
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: [{"name": n} for n in names])
    assert pool_replicas() == 1
