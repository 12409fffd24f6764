"""Imports run one way: the engine drives the executor, the executor runs the speculative
algorithms; no speculative module reaches back into the executor or the engine, the executor
never imports the engine, and no two modules import each other. Read from the source (every
import statement, inside functions too; `if TYPE_CHECKING:` blocks are not imports at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import outrider

ROOT = Path(outrider.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The outrider modules `name` imports (a `from package import name` counts the module
    `name` when it is one)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _edges(graph, source: str, targets: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted(
        (a, b)
        for a, bs in graph.items()
        for b in bs
        if a.startswith(source) and b.startswith(targets)
    )


def test_the_graph_reads_real_imports():
    graph = _graph()
    # Known edges, so a reader that found nothing would fail here rather than pass below.
    assert "outrider.executor.model_runner" in graph["outrider.engine.engine"]
    assert "outrider.speculative.tree_batch" in graph["outrider.executor.spec_step"]


def test_speculative_algorithms_import_neither_executor_nor_engine():
    assert _edges(_graph(), "outrider.speculative", ("outrider.executor", "outrider.engine")) == []


def test_the_executor_never_imports_the_engine():
    assert _edges(_graph(), "outrider.executor", ("outrider.engine",)) == []


def test_no_two_modules_import_each_other():
    graph = _graph()
    mutual = sorted({tuple(sorted((a, b))) for a, bs in graph.items() for b in bs if a in graph[b]})
    assert mutual == []
