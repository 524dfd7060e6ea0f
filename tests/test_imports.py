"""The parts of ``fairseq_attnzoo`` (its top-level modules and first-level subpackages) import each
other without a cycle, and so do the modules inside them (a subpackage's ``__init__`` and its own
modules) and those of ``scripts/``, counting the imports inside functions; the compatibility table
(``compat/``) imports nothing of ours but the user-facing messages (``messages/``) and the
checkpoint readers (``checkpoints.py``), and those two import nothing above them."""

import ast
import os
from typing import Dict, List, Optional, Tuple

import pytest

from preptest_util import REPO

PACKAGE = "fairseq_attnzoo"
PACKAGE_DIR = os.path.join(REPO, PACKAGE)
SCRIPTS_DIR = os.path.join(REPO, "scripts")

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


def _ours(name: str, known) -> Optional[str]:
    """The module of ours that importing ``name`` runs last (``a.b.c`` of a known ``a.b`` whose
    ``c`` is no module: ``a.b``), or None for another library's."""
    names = name.split(".")
    while names and ".".join(names) not in known:
        names.pop()
    return ".".join(names) or None


def _imports(package_dir: str):
    """``(module, path, lineno, imported name)`` for every import statement below ``package_dir``,
    at module level or inside a function."""
    known = _modules(package_dir)
    for module, path in sorted(known.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, is_package, known):
                    yield module, path, node.lineno, name


def module_graph(package_dir: str) -> Edges:
    """Every import between two modules below ``package_dir`` (a package's ``__init__`` counts as
    the package), at module level or inside a function."""
    known = _modules(package_dir)
    edges: Edges = {}
    for module, path, line, name in _imports(package_dir):
        target = _ours(name, known)
        if target is not None and target != module:
            where = f"{os.path.relpath(path, os.path.dirname(package_dir))}:{line}"
            edges.setdefault((module, target), where)
    return edges


def part(module: str) -> Optional[str]:
    """The part of ours ``module`` belongs to (the package itself for its ``__init__``), or None."""
    names = module.split(".")
    if names[0] != PACKAGE:
        return None
    return names[1] if len(names) > 1 else PACKAGE


def part_graph(package_dir: str = PACKAGE_DIR) -> Edges:
    """Every import between two parts, at module level or inside a function."""
    edges: Edges = {}
    for module, path, line, name in _imports(package_dir):
        a, b = part(module), part(name)
        if b is not None and a != b:
            where = f"{os.path.relpath(path, os.path.dirname(package_dir))}:{line}"
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


def _no_cycle(edges: Edges):
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + ", ".join(
        f"{a} -> {b} ({edges[a, b]})" for a, b in zip(cycle, cycle[1:]))


def test_no_import_cycle_between_parts():
    _no_cycle(part_graph())


@pytest.mark.parametrize("folder", [PACKAGE_DIR, SCRIPTS_DIR], ids=[PACKAGE, "scripts"])
def test_no_import_cycle_between_modules(folder):
    """Inside a part too: ``compat/__init__`` and ``compat/fixes``, ``scripts/bench/cases`` and
    ``harness`` once imported each other."""
    _no_cycle(module_graph(folder))


def _imported_by(importer: str) -> Dict[str, str]:
    return {b: where for (a, b), where in part_graph().items() if a == importer}


def test_compat_imports_only_the_messages_and_the_checkpoint_readers():
    imported = _imported_by("compat")
    assert set(imported) <= {"messages", "checkpoints"}, imported


def test_the_messages_stand_on_the_checkpoint_readers_alone():
    """``messages/`` reads checkpoints and nothing else of ours; the checkpoint readers, which the
    host's resume check uses too, import nothing of ours (so ``models/`` reads a checkpoint without
    the messages)."""
    assert set(_imported_by("messages")) <= {"checkpoints"}, _imported_by("messages")
    assert _imported_by("checkpoints") == {}


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    package = tmp_path / PACKAGE
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import models\n")
    (package / "models" / "__init__.py").write_text("def f():\n    from .. import compat\n")
    (package / "compat.py").write_text("import fairseq_attnzoo.models.x\nimport os\n")
    edges = part_graph(str(package))
    assert set(edges) == {(PACKAGE, "models"), ("models", "compat"), ("compat", "models")}
    assert find_cycle(edges) == ["compat", "models", "compat"]


def test_the_module_walk_sees_a_cycle_inside_a_subpackage(tmp_path):
    """``compat/__init__`` imports ``compat/fixes`` at its end, which imports the machinery back
    from ``compat/__init__``: no cycle between parts, one between modules."""
    compat = tmp_path / PACKAGE / "compat"
    compat.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (compat / "__init__.py").write_text("def register(p):\n    pass\n\nfrom .fixes import x\n")
    (compat / "fixes.py").write_text("def f():\n    from . import register\nx = 1\n")
    (compat / "table.py").write_text("import fairseq_attnzoo.compat.fixes.x\nimport os\n")
    package = str(tmp_path / PACKAGE)
    assert find_cycle(part_graph(package)) is None
    edges = module_graph(package)
    assert set(edges) == {(f"{PACKAGE}.compat", f"{PACKAGE}.compat.fixes"),
                          (f"{PACKAGE}.compat.fixes", f"{PACKAGE}.compat"),
                          (f"{PACKAGE}.compat.table", f"{PACKAGE}.compat.fixes")}
    assert find_cycle(edges) == [f"{PACKAGE}.compat", f"{PACKAGE}.compat.fixes",
                                 f"{PACKAGE}.compat"]
