"""The parts of ``fairseq_attnzoo`` (its top-level modules and first-level subpackages) import each
other without a cycle, counting the imports inside functions; the compatibility table (``compat/``)
imports nothing of ours but the user-facing messages (``messages/``)."""

import ast
import os
from typing import Dict, List, Optional, Tuple

PACKAGE = "fairseq_attnzoo"
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

Edges = Dict[Tuple[str, str], str]  # (importing part, imported part) -> the first "file:line"


def _modules(package_dir: str) -> Dict[str, str]:
    """``{dotted module name: path}`` of every .py file below ``package_dir``."""
    out = {}
    for folder, _, files in os.walk(package_dir):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(package_dir))[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


def _imported(node, module: str, is_package: bool, known) -> List[str]:
    """The modules an import statement names, relative imports resolved; ``from X import name``
    counts as ``X.name`` where that is a module of ours, else as ``X``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = []
    if node.level:
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
    source = ".".join(base + ([node.module] if node.module else []))
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def part(module: str) -> Optional[str]:
    """The part of ours ``module`` belongs to (the package itself for its ``__init__``), or None."""
    names = module.split(".")
    if names[0] != PACKAGE:
        return None
    return names[1] if len(names) > 1 else PACKAGE


def part_graph(package_dir: str = PACKAGE_DIR) -> Edges:
    """Every import between two parts, at module level or inside a function."""
    known = _modules(package_dir)
    edges: Edges = {}
    for module, path in sorted(known.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, is_package, known):
                a, b = part(module), part(name)
                if b is not None and a != b:
                    where = f"{os.path.relpath(path, os.path.dirname(package_dir))}:{node.lineno}"
                    edges.setdefault((a, b), where)
    return edges


def find_cycle(edges: Edges) -> Optional[List[str]]:
    """A cycle of parts ``[a, b, ..., a]``, or None."""
    graph: Dict[str, List[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    done, path = set(), []

    def visit(node) -> Optional[List[str]]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in graph.get(node, []):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_no_import_cycle_between_parts():
    edges = part_graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + ", ".join(
        f"{a} -> {b} ({edges[a, b]})" for a, b in zip(cycle, cycle[1:]))


def test_compat_imports_only_the_messages():
    edges = part_graph()
    imported = {b: where for (a, b), where in edges.items() if a == "compat"}
    assert set(imported) <= {"messages"}, imported


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    package = tmp_path / PACKAGE
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import models\n")
    (package / "models" / "__init__.py").write_text("def f():\n    from .. import compat\n")
    (package / "compat.py").write_text("import fairseq_attnzoo.models.x\nimport os\n")
    edges = part_graph(str(package))
    assert set(edges) == {(PACKAGE, "models"), ("models", "compat"), ("compat", "models")}
    assert find_cycle(edges) == ["compat", "models", "compat"]
