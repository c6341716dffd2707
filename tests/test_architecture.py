"""The import rules of docs/design.md, Shape, checked over grimp's import graph (every import statement, at module level
or inside a function; `if TYPE_CHECKING:` imports left out, they never run):

- layers: jobs -> cluster -> cluster.contracts <- actors;
- actors/ import only cluster/contracts/ of the driver's code;
- cluster/ reaches actors/ in one place, cluster/launch.py, where the driver starts actors;
- cluster/contracts/ import nothing else of the project (they are the bottom layer);
- no module of jobs/ is imported by cluster/ or actors/ (only jobs/ itself and benchmarks/ import jobs/);
- benchmarks/ (not installed) may import the product; the product (cluster/, actors/, jobs/) never imports it;
- no import cycles, between modules or between cluster/'s stage packages;
- every Python file of the product, and of benchmarks/, is under 400 lines.
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
