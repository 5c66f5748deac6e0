"""The code-health rules as tests, so that CI (``./install.sh --dev && .venv/bin/python -m
pytest``) enforces them: ruff and ``mypy --strict`` clean, no import circle inside ``agent``
(imports inside functions count: they are still a dependency, only a later one), the
subpackages importing only downwards through the layers the README's Layout describes, and
no module in ``agent/`` over 400 lines.

The tools are the ones the dev extras install into this interpreter's environment, run with
the configuration in pyproject.toml; their caches are the gitignored ``.ruff_cache`` and
``.mypy_cache`` of the checkout, so a second run takes seconds.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGE = "agent"
MAX_LINES = 400
# Lowest first.  A module may import its own subpackage and any lower layer; the
# subpackages of one layer are independent of each other.  "agent" is the package's
# __init__ (the version).
LAYERS: list[set[str]] = [
    {"agent"},
    {"kernel"},
    {"discovery", "validation"},
    {"yamlfile"},  # the one YAML loader of every user file: config, profiles, overlays, models
    # below tuning: kernel arguments (tuning's cmdline section) use the overlays' boot layouts
    {"overlays"},
    {"telemetry", "tuning", "inference"},
    {"protocol", "terminal", "stopping"},
    {"link"},
    {"control"},
    {"serving"},
    # model build and model tune: the CLI and the fleet command use them, nothing below
    {"modelbuild", "modeltune"},
    {"config"},
    {"service"},
    {"cli"},
    {"__main__"},
]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=CHECKOUT, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.timeout(900)  # its tools run under a 600 s timeout of their own; theirs reports better
def test_ruff_is_clean() -> None:
    result = run_tool("ruff", "check", "--no-fix", "agent", "tests", "bench", "scripts",
                      ".ci", "clients")
    assert result.returncode == 0, f"ruff check:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(900)  # its tools run under a 600 s timeout of their own; theirs reports better
def test_mypy_strict_is_clean() -> None:
    result = run_tool("mypy", "--strict", PACKAGE)
    assert result.returncode == 0, f"mypy --strict {PACKAGE}:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(900)  # as above
def test_mypy_strict_is_clean_for_the_client_distribution() -> None:
    """``clients/python`` under its own pyproject's configuration (run from there)."""
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "edge_agent_client"],
                            cwd=CHECKOUT / "clients" / "python", capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, f"mypy --strict edge_agent_client:\n{result.stdout}"


def test_no_module_in_agent_is_over_the_line_limit() -> None:
    lengths = {path.relative_to(CHECKOUT).as_posix(): len(path.read_text().splitlines())
               for path in sorted((CHECKOUT / PACKAGE).rglob("*.py"))}
    long = [f"{name}: {count} lines" for name, count in lengths.items() if count > MAX_LINES]
    assert not long, (f"over {MAX_LINES} lines (split by concern):\n" + "\n".join(long))


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted
    (iterative: the import graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
    return sorted(found)


def shortest_cycle(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """A shortest chain of imports from the component's first module back to it."""
    members, first = set(component), component[0]
    came_from: dict[str, str] = {}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node]):
            if successor not in members or successor in came_from:
                continue
            came_from[successor] = node
            if successor == first:
                chain = [first]
                while chain[-1] != first or len(chain) == 1:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            queue.append(successor)
    raise AssertionError(f"{component} is not strongly connected")


def test_strongly_connected_finds_each_circle_once() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"},
             "g": {"g", "a"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["e", "f"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_circles_in_agent() -> None:
    """Every strongly connected component of the module import graph is a circle, shown as
    one chain through it with the import line of each link."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    imports = {module: graph.find_modules_directly_imported_by(module)
               for module in graph.modules}
    circles = []
    for component in strongly_connected(imports):
        chain = shortest_cycle(imports, component)
        links = []
        for importer, imported in itertools.pairwise(chain):
            detail = graph.get_import_details(importer=importer, imported=imported)
            where = (f"line {detail[0]['line_number']}: {detail[0]['line_contents']}"
                     if detail else "")
            links.append(f"  {importer} -> {imported}  ({where})")
        circles.append(f"{' -> '.join(chain)}\n" + "\n".join(links)
                       + (f"\n  (the circle's modules: {', '.join(component)})"
                          if len(component) > len(chain) - 1 else ""))
    assert not circles, "import circles (lazy imports count):\n" + "\n".join(circles)


def _layer_of(module: str) -> tuple[str, int]:
    """The subpackage (or top-level module) of ``agent`` a module is in, and its layer."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "agent"
    for level, members in enumerate(LAYERS):
        if name in members:
            return name, level
    raise AssertionError(f"{module}: {name} is in no layer of LAYERS (add it where it fits)")


def layer_violations(imports: Mapping[str, Iterable[str]]) -> list[str]:
    """Each import that goes up a layer or sideways into another subpackage of its layer."""
    found = []
    for importer in sorted(imports):
        name, level = _layer_of(importer)
        for imported in sorted(imports[importer]):
            other, other_level = _layer_of(imported)
            if other != name and other_level >= level:
                found.append(f"{importer} -> {imported}")
    return found


def test_layer_check_catches_an_upward_and_a_sideways_import() -> None:
    imports = {"agent.kernel.fsroot": {"agent.discovery.cpu"},
               "agent.tuning.engine": {"agent.inference.loop", "agent.kernel.fsroot"},
               "agent.cli.fleet": {"agent.control.operator", "agent.cli.common"}}
    assert layer_violations(imports) == ["agent.kernel.fsroot -> agent.discovery.cpu",
                                         "agent.tuning.engine -> agent.inference.loop"]


def test_agent_imports_only_downwards_through_its_layers() -> None:
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    imports = {module: graph.find_modules_directly_imported_by(module)
               for module in graph.modules}
    found = layer_violations(imports)
    assert not found, "imports against the layers (LAYERS, lazy imports count):\n" + \
        "\n".join(found)
