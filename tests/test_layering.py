"""The package's import graph: the engine sits below its tools, and no module imports
itself back through others.

The graph is read from the source with ``ast`` (nothing is imported), and it counts
imports inside functions too: a lazy import that closes a cycle still ties the two
modules together (neither can be understood, tested or moved alone), and a lazy
import of a tool from the engine still puts the engine above it.

Layers: ``cyllm.tools.*`` (the command line, the server, bench/tune/perplexity/
convert/quantize/info, synthetic weights) may import the engine; the engine (every
other module) may not import ``cyllm.tools``. ``cyllm.__main__`` is the
``python -m cyllm`` entry point, i.e. the command line, so it counts as a tool.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# compiled packages, not Python sources: cyllm._ext (cython_ext/), cyllm._cuda (cuda/)
COMPILED = ("cyllm._ext", "cyllm._cuda")
TOOL_MODULES = ("cyllm.tools", "cyllm.__main__")


def source_modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """{module name: (path, is a package)} for every .py file under src/cyllm."""
    out = {}
    for p in sorted((src / "cyllm").rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (p, is_pkg)
    return out


def _target(name: str, modules) -> str | None:
    """The source module an imported dotted name lands in (None: outside cyllm or compiled)."""
    if not (name == "cyllm" or name.startswith("cyllm.")) or name.startswith(COMPILED):
        return None
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """{module: the cyllm modules it imports}, module-level and function-level imports both.

    ``from pkg import name`` is an edge to pkg.name when that is a module, else to pkg
    (its __init__ defines the name). The implicit import of a module's parent packages
    is not an edge: every submodule import runs them, so counting it would tie every
    package to each of its lazily imported submodules."""
    modules = source_modules(src)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in modules.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                           for a in node.names]
            else:
                continue
            for t in targets:
                t = _target(t, modules)
                if t is not None and t != mod:
                    edges.add(t)
        graph[mod] = edges
    return graph


def is_tool(mod: str) -> bool:
    return any(mod == t or mod.startswith(t + ".") for t in TOOL_MODULES)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_is_read():
    """Guards the two tests below against passing on an empty or misread graph."""
    g = import_graph()
    assert "cyllm.backends.cpu" in g["cyllm.backends"]           # function-level import
    assert "cyllm.model" in g["cyllm"]
    assert "cyllm.errors" in g["cyllm.model"]
    assert "cyllm.generate" in g["cyllm.tools.cli"] or "cyllm.tools.repl" in g["cyllm.tools.cli"]
    assert not any(t.startswith(COMPILED) for edges in g.values() for t in edges)


def test_the_engine_does_not_import_the_tools():
    g = import_graph()
    upward = sorted(f"{m} -> {t}" for m, edges in g.items() if not is_tool(m)
                    for t in edges if is_tool(t))
    assert not upward, "engine modules import tools:\n" + "\n".join(upward)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
