"""Import arrows run one way: pages -> ui -> measure -> workloads / server -> engine ->
models, the fleet simulation beside measure (ui may import it; it may import measure,
workloads and engine; none of those import it), and no modules import each other in a
circle.

The modules are parsed, not imported, so every import is seen (inside functions and
`if TYPE_CHECKING:` blocks too) and nothing heavy loads.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_ENGINE_MODULES = 16

# package -> top-level names its modules must never import
FORBIDDEN = {
    "engine": {"workloads", "measure", "ui", "pages", "server", "batchlens", "streamlit",
               "fleet"},
    "measure": {"ui", "pages", "streamlit", "fleet"},
    "workloads": {"ui", "pages", "streamlit", "measure", "fleet"},
    "server": {"ui", "pages", "streamlit", "workloads", "measure", "fleet"},
    "fleet": {"ui", "pages", "streamlit", "server", "batchlens"},
    "ui": {"pages"},
}


def imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the code of `module`
    (dotted, e.g. "engine.models.llama"); relative imports are resolved against it."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, name))
    return found


def _parse(source: str) -> ast.Module:
    """`ast.parse` with the garbage collector held off: on CPython 3.11 a finalizer that
    runs during the parse and formats a traceback (an asyncio task an earlier test left
    behind) re-enters the AST constructor and fails it with "AST constructor recursion
    depth mismatch" (the callers collect such leftovers first)."""
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        gc.enable()


def modules(package: str) -> list[tuple[Path, str]]:
    """(file, dotted module name) of every .py file under `package`."""
    files = sorted((ROOT / package).rglob("*.py"))
    return [(f, ".".join(f.relative_to(ROOT).with_suffix("").parts)) for f in files]


def back_edges(package: str) -> list[str]:
    out = []
    for path, module in modules(package):
        for line, name in imports(path.read_text(), module):
            if name.split(".")[0] in FORBIDDEN[package]:
                out.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return out


def test_the_import_walker_sees_every_kind_of_import() -> None:
    source = ("import os, ui.shared\nfrom . import config\nfrom ..workloads import race\n"
              "def f():\n    from streamlit import session_state\n"
              "if TYPE_CHECKING:\n    from measure.hardware import Profile\n")
    assert sorted(imports(source, "engine.models.llama")) == [
        (1, "os"), (1, "ui.shared"), (2, "engine.models"), (3, "engine.workloads"),
        (5, "streamlit"), (7, "measure.hardware")]
    assert imports("from . import x\n", "engine.core") == [(1, "engine")]
    assert modules("engine") and all(m.startswith("engine.") for _, m in modules("engine"))


def test_each_package_imports_only_downward() -> None:
    gc.collect()  # finalize what earlier tests left before parsing (see `_parse`)
    for package in FORBIDDEN:
        assert (ROOT / package).is_dir(), f"{package}/ is missing"
        edges = back_edges(package)
        assert not edges, (f"{package}/ must not import {', '.join(sorted(FORBIDDEN[package]))}:"
                           "\n  " + "\n  ".join(edges))


def test_engine_holds_the_serving_core_only() -> None:
    """Top-level engine modules <= 16, each with one job; subpackages (models/,
    attention/, ...) hold a job's parts."""
    found = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(found) <= MAX_ENGINE_MODULES, (
        f"engine/ has {len(found)} top-level modules (at most {MAX_ENGINE_MODULES}, each with "
        "one job; subpackages hold a job's parts): " + ", ".join(found))


# ---- no cycles between modules ---------------------------------------------------------
PACKAGES = ("engine", "measure", "workloads", "server", "fleet", "ui", "batchlens", "pages")


def module_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (a package's `__init__` is
    the package's own name; `from pkg import mod` points at the module `pkg.mod`)."""
    files = {m.removesuffix(".__init__"): p for pkg in PACKAGES for p, m in modules(pkg)}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        dotted = module + (".__init__" if path.name == "__init__.py" else "")
        edges = graph.setdefault(module, set())
        for node in ast.walk(_parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                package = dotted.split(".")[:-1]
                base = package[: len(package) - node.level + 1] if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in files else name
                           for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_in_a_circle() -> None:
    gc.collect()  # see `_parse`
    found = cycles(module_graph())
    assert not found, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)
