"""The shape of the house, checked: imports form a DAG, ``core`` imports no Lightning, torch's and
Lightning's internals are reached through their compat modules only, and files stay readable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_gpuopt"
COMPAT_MODULES = {"lightning_gpuopt.core._torch_compat", "lightning_gpuopt.callbacks._lightning_compat"}
MAX_FILE_LINES = 600
MAX_PACKAGE_LINES = 12_000  # issue 22: at most 12,000 package lines


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of each import; ``top_level_only``: not inside a function or ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    if top_level_only:
        for node in ast.walk(tree):
            inner = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if inner or (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                skipped |= {id(child) for child in ast.walk(node) if child is not node}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def _internal_edges(name: str) -> set[str]:
    """The package modules ``name`` imports at module level (``from package import module`` included)."""
    edges = set()
    for module, names, _ in _imports(MODULES[name], top_level_only=True):
        for target in [module, *(f"{module}.{n}" for n in names)]:
            if target in MODULES and target != name:
                edges.add(target)
    return edges


def test_module_level_imports_form_a_dag() -> None:
    graph = {name: _internal_edges(name) for name in MODULES}
    visiting, done, cycles = set(), set(), []

    def visit(node: str, path: list[str]) -> None:
        if node in done:
            return
        if node in visiting:
            cycles.append([*path[path.index(node) :], node])
            return
        visiting.add(node)
        for target in sorted(graph[node]):
            visit(target, [*path, node])
        visiting.discard(node)
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    # a package's __init__ re-exporting its modules is not a cycle through them
    real = [c for c in cycles if not any(c[i] == c[i + 1].rpartition(".")[0] for i in range(len(c) - 1))]
    assert not real, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in real)


def test_core_never_imports_lightning() -> None:
    offenders = [
        f"{name}:{line} imports {module}"
        for name, path in MODULES.items()
        if name.startswith("lightning_gpuopt.core")
        for module, _, line in _imports(path, top_level_only=False)
        if module.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
    ]
    assert not offenders, offenders


def _private(module: str, names: list[str]) -> bool:
    if module.split(".")[0] not in ("torch", "lightning", "pytorch_lightning", "lightning_fabric"):
        return False
    return any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names)


def test_torch_and_lightning_internals_are_imported_by_their_compat_modules_only() -> None:
    outside = [
        f"{name}:{line} from {module} import {', '.join(names)}"
        for name, path in MODULES.items()
        if name not in COMPAT_MODULES
        for module, names, line in _imports(path, top_level_only=False)
        if _private(module, names)
    ]
    assert len(outside) <= 3, outside


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_is_readable_in_one_sitting(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{name} has {lines} lines (at most {MAX_FILE_LINES})"


def test_the_package_stays_small() -> None:
    total = sum(len(path.read_text().splitlines()) for path in MODULES.values())
    assert total <= MAX_PACKAGE_LINES, f"{total} lines in lightning_gpuopt (at most {MAX_PACKAGE_LINES})"
