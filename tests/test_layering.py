"""The packages' layering (DESIGN.md, ../shared/whiteboard.json): nothing imports a package
above it, and no module imports itself back through others. Reads the imports of every module
of ours (tests excluded), at any depth of the file: a lazy import inside a function is an
arrow all the same."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dse", "sim", "predictor", "router", "backends", "orchestrator")

# package -> packages of ours it must never import
NEVER = {
    "dse": {"sim", "predictor", "router", "backends", "orchestrator"},
    "sim": {"orchestrator", "router", "backends", "predictor"},
    "router": {"orchestrator", "backends"},
    "backends": {"router", "orchestrator"},
    "predictor": {"router", "orchestrator", "backends", "sim"},
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Absolute names of every module ``name`` imports (``from a import b``: ``a.b`` when that
    is a module, else ``a``)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return {m: {i for i in imports_of(m, p) if i in mods and i != m} for m, p in mods.items()}


def test_reads_every_package(graph):
    assert {m.split(".")[0] for m in graph} >= {"dse", "sim", "router", "orchestrator"}
    assert "orchestrator.cluster.simulator" in graph and "dse.costmodel" in graph


@pytest.mark.parametrize("pkg", sorted(NEVER))
def test_no_package_imports_one_above_it(graph, pkg):
    bad = sorted(f"{m} -> {i}" for m, deps in graph.items() if m.split(".")[0] == pkg
                 for i in deps if i.split(".")[0] in NEVER[pkg])
    assert not bad, "imports that run back up: " + ", ".join(bad)


def test_no_module_import_cycle(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_a_violation(tmp_path):
    """The reader resolves relative imports (so a violation written that way is caught)."""
    f = tmp_path / "x.py"
    f.write_text("from ..orchestrator.policy import Policy\nimport router.routing\n"
                 "def g():\n    from . import y\n")
    got = imports_of("sim.x", f)
    assert {"orchestrator.policy", "orchestrator.policy.Policy", "router.routing",
            "sim.y"} <= got
