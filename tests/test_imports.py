"""The import graph of llmq's rooms: no circles, and no room imports one above it.

Read from the source with `ast` (nothing is imported), counting every import statement:
at module level, under `TYPE_CHECKING` and inside functions. A deferred import that closes
a circle still means two modules that cannot be read, tested or moved apart. The rules are
docs/architecture.md's "The rooms and what may import what".
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "workers", "api", "llmq")


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` (a package is its
    `__init__.py`)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module of ours that `name` names, or its closest enclosing one; None if none."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """Every module of ours that `module` imports anywhere in its file. `from pkg import x`
    counts as importing `pkg.x` when that is a module, else `pkg`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                names.append(child if child in modules else base)
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as a path that starts and ends
    at the same module (Tarjan's algorithm, iterative: the graph has hundreds of nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [_circle_through(group, graph) for group in groups]


def _circle_through(group: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest import path from the group's first module back to itself."""
    members, first = set(group), group[0]
    previous: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(previous[path[-1]])
                    return [first, *reversed(path[:-1]), first] if node != first else [first]
                if child in members and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return group


def test_the_cycle_finder_names_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_type_only_imports(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "one.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.two import X\n"
    )
    (tmp_path / "pkg" / "two.py").write_text("def f():\n    from pkg import one\n")
    graph = import_graph(module_files(tmp_path, ["pkg"]))
    assert graph["pkg.one"] == {"pkg.two"} and graph["pkg.two"] == {"pkg.one"}
    assert find_cycles(graph) == [["pkg.one", "pkg.two", "pkg.one"]]


def test_no_module_of_llmq_is_on_an_import_circle() -> None:
    cycles = find_cycles(import_graph(module_files()))
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _room_breaches(graph: Mapping[str, set[str]]) -> list[str]:
    def allowed(module: str, target: str) -> bool:
        room, other = module.split(".")[0], target.split(".")[0]
        if room == other and room != "workers":
            return True
        if room == "runtime":
            return False  # the engine stands alone
        if room == "workers":
            wire = target == "workers.keys" or target.startswith("workers.wire")
            if module == "workers.keys" or module.startswith("workers.wire"):
                return wire  # the shared wire pulls in nothing else of ours
            return other in ("workers", "runtime")
        if room == "api":
            if other == "workers":
                return target == "workers.keys" or target.startswith("workers.wire")
            return other == "runtime" and not target.startswith(ENGINE_ONLY)
        return True  # llmq: the front door may start any room

    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if not allowed(m, t))


ENGINE_ONLY = ("runtime.engine", "runtime.generator", "runtime.kernels", "runtime.models")


def test_no_room_imports_one_it_must_not() -> None:
    assert _room_breaches(import_graph(module_files())) == []
    assert _room_breaches({"workers.wire.job": {"runtime.request"}}) == [
        "workers.wire.job -> runtime.request"
    ]
    assert _room_breaches({"api.flow": {"runtime.engine"}, "runtime.x": {"api.app"}}) == [
        "api.flow -> runtime.engine",
        "runtime.x -> api.app",
    ]


def test_the_tokenizer_loads_neither_the_sampler_nor_llguidance() -> None:
    """The API reads tokenizers to check requests; that must not pull in the sampler."""
    import subprocess
    import sys

    code = (
        "import sys, runtime.tokenizer, runtime.detokenizer;"
        "print(sorted(m for m in ('llguidance', 'runtime.sampling') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
