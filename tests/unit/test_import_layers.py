"""Imports run one way, down the house (STYLE rule 15, DESIGN's package layout): engine ->
executor -> speculative -> models -> layers -> distributed -> loaders -> core/config/env. The
engine drives the executor, the executor runs the speculative algorithms and the models, models
are built of layers, layers hold the tensor-parallel group; nothing reaches back up, and no two
modules import each other. Read from the source (every import statement, inside functions
too; `if TYPE_CHECKING:` blocks are not imports at run time).

The runner owns its state (STYLE rule 13): what it holds is set through its own methods, whose
docstrings state when, so no module but its own assigns an attribute of a runner."""

from __future__ import annotations

import ast
from pathlib import Path

import outrider

ROOT = Path(outrider.__file__).parent

# The house's floors, top to bottom: a module may import its own floor and those below it. A
# module on no floor (server, train, plan, bench, testing, the CLI, the offline API) stands
# above the engine and may import any floor; no module on a floor imports it. The loaders
# stand below the layers (which read quantization schemes from them) and the TP group, as
# DESIGN lists them; the ground floor is plain data, config, the environment and the leaf
# helpers that the floors above use.
FLOORS = (
    ("outrider.engine",),
    ("outrider.executor",),
    ("outrider.speculative",),
    ("outrider.models",),
    ("outrider.layers",),
    ("outrider.distributed",),
    ("outrider.loaders",),
    (
        "outrider.core",
        "outrider.config",
        "outrider.config_fields",
        "outrider.env",
        "outrider.device",
        "outrider.transfer",
        "outrider.progress",
        "outrider.registry",
    ),
)
# Imports that still run up a floor, each with why it stands. Fixing one fails the test below
# until it leaves this list, so the list only shrinks.
KNOWN_UPWARD = {
    ("outrider.models.eagle3_io", "outrider.speculative.eagle3_vocab"): (
        "load_drafter checks a stored d2t/t2d with the speculative vocab checks: its own change"
    ),
}


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


def _floor(name: str) -> int:
    """Index in FLOORS (0 the top); -1 for a module on no floor, above them all."""
    for i, prefixes in enumerate(FLOORS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return -1


def _upward(graph) -> list[tuple[str, str]]:
    """(importer, imported) where a module on a floor imports one on a higher floor, or one on
    none. `outrider` itself is no edge: `from outrider import env` runs its __init__, which
    imports nothing until a name is asked of it."""
    return sorted(
        (a, b)
        for a, bs in graph.items()
        if _floor(a) >= 0
        for b in bs
        if b != "outrider" and _floor(b) < _floor(a)
    )


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
    assert "outrider.distributed" in graph["outrider.layers.linear"]
    # Every name on a floor is a module, so one renamed cannot slip off its floor unnoticed.
    named = [p for floor in FLOORS for p in floor]
    assert [p for p in named if not any(m == p or m.startswith(p + ".") for m in graph)] == []


def test_imports_run_down_the_house():
    assert _upward(_graph()) == sorted(KNOWN_UPWARD)


def test_only_benchmarks_and_tests_import_the_stand_ins():
    """outrider.testing (synthetic drafts for benchmarks and tests) is no part of serving."""
    graph = _graph()
    assert "outrider.testing.synthetic" in graph["outrider.testing.synthetic_drafter"]
    users = sorted(
        (a, b)
        for a, bs in graph.items()
        if not a.startswith("outrider.testing")
        for b in bs
        if b.startswith("outrider.testing")
    )
    assert users == []


def test_speculative_algorithms_import_neither_executor_nor_engine():
    assert _edges(_graph(), "outrider.speculative", ("outrider.executor", "outrider.engine")) == []


def test_the_executor_never_imports_the_engine():
    assert _edges(_graph(), "outrider.executor", ("outrider.engine",)) == []


def test_models_and_layers_import_neither_executor_nor_engine():
    graph = _graph()
    for source in ("outrider.models", "outrider.layers"):
        assert _edges(graph, source, ("outrider.executor", "outrider.engine")) == []


def test_loaders_import_neither_models_nor_executor_nor_engine():
    targets = ("outrider.models", "outrider.executor", "outrider.engine")
    assert _edges(_graph(), "outrider.loaders", targets) == []


def test_no_two_modules_import_each_other():
    graph = _graph()
    mutual = sorted({tuple(sorted((a, b))) for a, bs in graph.items() for b in bs if a in graph[b]})
    assert mutual == []


# -- the runner's state is set by the runner -------------------------------------------------

RUNNER_MODULE = "outrider.executor.model_runner"


def _names_a_runner(node: ast.expr) -> bool:
    """`runner`, `self._runner`, `engine.runner`: a name or attribute ending in "runner"."""
    if isinstance(node, ast.Name):
        return node.id.endswith("runner")
    return isinstance(node, ast.Attribute) and node.attr.endswith("runner")


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement binds, tuples and starred targets unpacked."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        pending = [node.target]
    else:
        return []
    out = []
    while pending:
        t = pending.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            pending += t.elts
        elif isinstance(t, ast.Starred):
            pending.append(t.value)
        else:
            out.append(t)
    return out


def _runner_assignments(source: str) -> list[str]:
    """Every `<runner>.attr = ...` (augmented, annotated and unpacked ones too) and every
    `setattr(<runner>, ...)` in `source`, unparsed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _names_a_runner(t.value):
                found.append(ast.unparse(t))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and _names_a_runner(node.args[0])
        ):
            found.append(ast.unparse(node))
    return found


def test_the_assignment_scan_sees_every_form():
    """Every way of assigning a runner's attribute is found; binding a runner to a name or
    calling its methods is not such an assignment."""
    source = """
runner.graphs = None
self._runner.aux_layers: tuple = ()
self.runner.drafter, (engine.runner.spec_ks, *rest) = a, b
runner.calls += 1
setattr(model_runner, "spec_step", None)
self.runner = runner
runner.run(batch)
"""
    assert sorted(_runner_assignments(source)) == sorted(
        [
            "runner.graphs",
            "self._runner.aux_layers",
            "self.runner.drafter",
            "engine.runner.spec_ks",
            "runner.calls",
            "setattr(model_runner, 'spec_step', None)",
        ]
    )


def test_only_the_runner_assigns_its_attributes():
    modules = _modules()
    assert RUNNER_MODULE in modules
    found = {
        name: hits
        for name, path in modules.items()
        if name != RUNNER_MODULE and (hits := _runner_assignments(path.read_text()))
    }
    assert found == {}, (
        f"modules assign a runner's attributes: {found}; call a ModelRunner method that "
        "states when that state may change (set_speculation, set_aux_layers, ...) instead"
    )
