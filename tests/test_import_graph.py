"""trainmon's import graph, read from the source, has no cycle.

What counts as an edge: every ``import`` / ``from ... import`` a module of trainmon
holds, at module level *and* inside functions, relative ones included. An import moved
into a function to dodge a cycle still ties the two modules together (ddl.py and
rollups.py did exactly that), so the layering this test guards would not show
otherwise. Left out: imports under ``if TYPE_CHECKING:`` (they never run), and the
implicit import of a module's parent packages (a package's ``__init__`` re-exporting
its own modules is how Python packages are made, not a cycle).

``from . import x`` is an edge to module ``x`` when the package has one, else to the
package itself (``x`` is then a name the package defines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import trainmon

PACKAGE_DIR = Path(trainmon.__file__).parent

# Cycles known and owned elsewhere, as the set of modules in them. Each entry is removed
# by whoever breaks its cycle.
KNOWN_CYCLES: list[set[str]] = []


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, however deeply nested, except under ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking_only(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
                    modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: climb from the module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = module_files(package_dir)
    graph = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            for name in _imported_names(module, is_package, node, modules):
                while name and name not in modules:  # "pkg.mod.Name" -> "pkg.mod"
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles (a -> b -> ... -> a) a depth-first search meets: each edge back to a
    module on the current path closes one; a loop over the same modules is named once."""
    found, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path, stack = [], set(), [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                loop = path[path.index(child):] + [child]
                if all(set(loop) != set(seen) for seen in found):
                    found.append(loop)
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return found


def test_trainmon_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    assert "trainmon.consumers.clickhouse.ddl" in graph  # the walk found the package's modules
    unknown = [loop for loop in cycles(graph) if set(loop) not in KNOWN_CYCLES]
    assert not unknown, "import cycles:\n" + "\n".join(" -> ".join(loop) for loop in unknown)


def test_a_cycle_closed_inside_a_function_is_found_and_named(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from .sub import b\nA = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def late():\n    from ..a import A\n    return A\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from . import a\n")
    graph = import_graph(package)
    assert graph["pkg.typed"] == set()  # TYPE_CHECKING imports never run
    assert graph["pkg"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
