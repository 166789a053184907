"""The import graph of engine/ and omlx_desktop/, read with `ast` (no module is imported).

Counts what `../shared/tools/import_map.py` counts: imports inside functions too, relative
imports resolved, `if TYPE_CHECKING:` imports included (they are coupling too), a package's
`__init__` importing its own submodules left out. Three rules:

- the engine never imports Qt, pyqtgraph or the desktop package;
- engine/errors, engine/kernels and engine/kv, from the ground up, each import only themselves and
  the floors below them;
- no import circle, except those in ALLOWED_CIRCLES, which may only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "omlx_desktop")
FLOORS = ("engine.errors", "engine.kernels", "engine.kv")   # from the ground up
QT_PREFIXES = ("PySide6", "PyQt5", "PyQt6", "shiboken6", "pyqtgraph", "omlx_desktop")

# Today's circles, each to be broken, never joined by a new one. A circle that shrinks or goes
# fails the test too, naming the circles to write here instead: the list only gets shorter.
# None today: the window's controllers annotate it as omlx_desktop.window_surface.WindowSurface
# (a Protocol) instead of importing omlx_desktop.window (issue 29).
ALLOWED_CIRCLES: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def absolute_base(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(source: str, current: str, is_package: bool) -> list[str]:
    """Every module or `module.name` the source imports, absolute, wherever the import stands."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(current, is_package, node)
            names += [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
    return names


def owning_module(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` is or lies inside (`engine.catalog.models_dir` →
    `engine.catalog`), None for an outside library."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def read_graph():
    files = sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py"))
    known = {module_name(f) for f in files}
    raw, edges = {}, {}
    for f in files:
        current = module_name(f)
        raw[current] = imported_names(f.read_text(encoding="utf-8"), current, f.name == "__init__.py")
        targets = edges.setdefault(current, set())
        for name in raw[current]:
            target = owning_module(name, known)
            if target is None or target == current:
                continue
            if f.name == "__init__.py" and target.startswith(current + "."):
                continue
            targets.add(target)
    return raw, edges


RAW, EDGES = read_graph()


def within(module: str, floor: str) -> bool:
    return module == floor or module.startswith(floor + ".")


def circles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], set()
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
    return found


def test_engine_imports_no_qt_and_no_desktop():
    bad = [f"{module} imports {name}" for module, names in sorted(RAW.items()) if within(module, "engine")
           for name in names if name.split(".")[0] in QT_PREFIXES]
    assert not bad, "the engine must run without Qt:\n" + "\n".join(bad)


def test_lower_floors_import_nothing_above_them():
    bad = []
    for i, floor in enumerate(FLOORS):
        allowed = FLOORS[: i + 1]
        for module, targets in sorted(EDGES.items()):
            if within(module, floor):
                bad += [f"{module} -> {t}" for t in sorted(targets)
                        if not any(within(t, a) for a in allowed)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_circles_beyond_the_allowed_ones():
    found = circles(EDGES)
    new = [sorted(c) for c in found - ALLOWED_CIRCLES]
    gone = [sorted(c) for c in ALLOWED_CIRCLES - found]
    assert not new and not gone, (
        f"circles not in ALLOWED_CIRCLES (break them): {new}\n"
        f"ALLOWED_CIRCLES entries no longer found (write today's circles instead): {gone}")


def test_the_reader_sees_what_import_map_sees():
    source = ("from __future__ import annotations\n"
              "from typing import TYPE_CHECKING\n"
              "from ..errors import CatalogError\n"
              "if TYPE_CHECKING:\n    from .pool import Pool\n"
              "def later():\n    from . import cache\n    import PySide6.QtCore\n")
    assert set(imported_names(source, "engine.kv.paged", False)) >= {
        "engine.errors.CatalogError", "engine.kv.pool.Pool", "engine.kv.cache", "PySide6.QtCore"}
    assert imported_names("from . import a", "engine.kv", True) == ["engine.kv.a"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == {frozenset("abc")}
