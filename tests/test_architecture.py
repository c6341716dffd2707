"""The import rules of docs/design.md, Shape, checked over grimp's import graph (every import statement, at module level
or inside a function; `if TYPE_CHECKING:` imports left out, they never run):

- layers: jobs -> cluster -> cluster.contracts <- actors;
- actors/ import only cluster/contracts/ of the driver's code;
- cluster/ reaches actors/ in one place, cluster/launch.py, where the driver starts actors;
- cluster/contracts/ import nothing else of the project (they are the bottom layer);
- no module of jobs/ is imported by cluster/ or actors/ (only jobs/ itself and benchmarks/ import jobs/);
- benchmarks/ (not installed) may import the product; the product (cluster/, actors/, jobs/) never imports it;
- no import cycles, between modules or between cluster/'s stage packages;
- every Python file of the product, and of benchmarks/, is under 400 lines;
- the schedule stage (cluster/schedule/): its core (the scheduler's loop, the fleet of actors, what they move,
  bisection, tail splits, engine starts, kept actors, progress) reaches only the contracts; the one module that
  routes models to the engine pool reaches cluster/pool/, the one that sizes and spawns the fleet the actor
  class (cluster/launch.py); those parts are composed in one place, run.py (which feeds the plans in); each file is
  under 300 lines.
"""

from pathlib import Path

import grimp  # in the dev extra
import pytest

from tests.conftest import ROOT

LAUNCH = "cluster.launch"
CONTRACTS = "cluster.contracts"
PRODUCT = ("cluster", "actors", "jobs")  # the installed packages (pyproject.toml's packages.find)
BENCHMARKS = "benchmarks"  # run from the repository's root, never installed
MAX_LINES = 400
SCHEDULE = "cluster.schedule"
SCHEDULE_CORE = {f"{SCHEDULE}.{name}" for name in (
    "scheduler", "fleet", "work", "bisection", "tail_split", "engine_starts", "progress", "actor_io")}
# the part of the core that decides: Ray reaches it only through cluster/schedule/actor_io.py
SCHEDULE_DECIDES = {f"{SCHEDULE}.{name}" for name in ("scheduler", "fleet", "work", "bisection", "tail_split",
                                                      "engine_starts")}
SCHEDULE_PARTS = {f"{SCHEDULE}.{name}" for name in ("fleet_size", "engine_sources")}  # composed by run.py
MAX_SCHEDULE_LINES = 300


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PRODUCT, BENCHMARKS, exclude_type_checking_imports=True)


def _imports(graph):
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            yield module, imported


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_actors_import_only_the_contracts_of_the_driver(graph):
    wrong = [(m, i) for m, i in _imports(graph) if _in(m, "actors") and _in(i, "cluster") and not _in(i, CONTRACTS)]
    assert wrong == []


def test_the_driver_reaches_actors_only_where_it_starts_them(graph):
    wrong = [(m, i) for m, i in _imports(graph) if _in(m, "cluster") and _in(i, "actors") and m != LAUNCH]
    assert wrong == []


def test_contracts_are_the_bottom_layer(graph):
    wrong = [(m, i) for m, i in _imports(graph) if _in(m, CONTRACTS) and not _in(i, CONTRACTS)]
    assert wrong == []


def test_nothing_but_jobs_and_benchmarks_imports_jobs(graph):
    wrong = [(m, i) for m, i in _imports(graph) if _in(i, "jobs") and not (_in(m, "jobs") or _in(m, BENCHMARKS))]
    assert wrong == []


def test_the_product_never_imports_the_benchmarks(graph):
    assert any(_in(m, BENCHMARKS) for m in graph.modules)  # the graph holds them: the rule is not vacuous
    wrong = [(m, i) for m, i in _imports(graph) if _in(i, BENCHMARKS) and not _in(m, BENCHMARKS)]
    assert wrong == []


def test_the_benchmarks_are_not_installed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{p}*" for p in PRODUCT)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), iteratively."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_between_modules(graph):
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def test_no_import_cycles_between_the_drivers_stages(graph):
    """cluster/'s sub-packages (spec, inputs, plan, schedule, store, score, pool) depend on each other one way."""
    def stage(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == "cluster" and len(parts) > 1 else parts[0]

    edges: dict[str, set[str]] = {}
    for m, i in _imports(graph):
        a, b = stage(m), stage(i)
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b and a.startswith("cluster.") and b.startswith("cluster."):
            edges[a].add(b)
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_product_and_benchmark_file_is_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted(Path(ROOT).glob("*/**/*.py"))
            if p.parts[len(ROOT.parts)] in (*PRODUCT, BENCHMARKS)
            and (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert long == {}


def test_the_schedulers_core_reaches_only_the_contracts(graph):
    """It is handed models and shards and reports events: sizing, routing, planning, scoring and the store are
    composed around it (cluster/schedule/run.py), never reached from it."""
    assert SCHEDULE_CORE <= set(graph.modules)  # the rule names modules that are there: it is not vacuous
    wrong = [(m, i) for m, i in _imports(graph)
             if m in SCHEDULE_CORE and _in(i, "cluster") and not (_in(i, CONTRACTS) or i in SCHEDULE_CORE)]
    assert wrong == []


def test_the_scheduler_decides_without_importing_ray():
    """Its waits, answers and kills are cluster/schedule/actor_io.py's (tests/test_scheduler_core.py runs it over a
    stand-in of that, with no Ray)."""
    with_packages = grimp.build_graph("cluster", include_external_packages=True, exclude_type_checking_imports=True)
    assert SCHEDULE_DECIDES <= set(with_packages.modules)
    assert ("cluster.schedule.actor_io", "ray") in set(_imports(with_packages))  # Ray is in this graph: not vacuous
    wrong = [(m, i) for m, i in _imports(with_packages) if m in SCHEDULE_DECIDES and _in(i, "ray")]
    assert wrong == []


def test_the_schedule_stage_reaches_the_pool_and_the_actor_class_each_from_one_module(graph):
    owners = {"cluster.pool": f"{SCHEDULE}.engine_sources", LAUNCH: f"{SCHEDULE}.fleet_size"}
    wrong = [(m, i) for m, i in _imports(graph) if _in(m, SCHEDULE)
             for reached, owner in owners.items() if _in(i, reached) and m != owner]
    assert wrong == []


def test_the_sweeps_parts_are_composed_in_one_place(graph):
    assert SCHEDULE_PARTS <= set(graph.modules)
    wrong = [(m, i) for m, i in _imports(graph) if i in SCHEDULE_PARTS and m != f"{SCHEDULE}.run"]
    assert wrong == []


def test_every_schedule_file_is_under_300_lines():
    long = {p.name: n for p in sorted((Path(ROOT) / "cluster" / "schedule").glob("*.py"))
            if (n := len(p.read_text().splitlines())) >= MAX_SCHEDULE_LINES}
    assert long == {}
