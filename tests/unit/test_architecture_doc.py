"""docs/architecture.md matches the code: every path it names exists where it says (a test named
as `path::test_name` is defined in that file), every class it names is defined in outrider/,
every `Class.member` is a member of that class, every function or field named in backticks is
defined somewhere in outrider/, and the page stays one page.

Read from the source with ast (nothing is imported), so a renamed file, class, method or
function fails here with the name to fix in the page."""

from __future__ import annotations

import ast
import builtins
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 260  # one page, read in ten minutes
FIX = "update docs/architecture.md to name what the code has now"

# A path from the repository root anywhere in the page, code blocks included; a test file may
# name one of its tests after `::`. Trailing sentence punctuation is not part of the path.
PATH = re.compile(r"(?<![\w./-])((?:outrider|tests|benchmarks|docs)/[\w./*-]*)(?:::(\w+))?")
SPAN = re.compile(r"`([^`\n]+)`")  # inline code, outside fenced blocks
FILE_LIKE = re.compile(r"^[\w.*-]+(/[\w.*-]*)*(::\w+)?$")
MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)")  # `Class.member`, `Class.method(...)`
CLASS = re.compile(r"^[A-Z]\w*[a-z]\w*$")  # a bare CamelCase name
FUNCTION = re.compile(r"^([a-z_][a-z0-9_]*)(\(.*\))?$")  # `snake_name`, `snake_name(...)`
BUILTINS = set(dir(builtins))


@dataclass
class Index:
    """What outrider/ defines: classes with their members (by class name, every definition's
    members together, `self.x` included), and every name defined anywhere: functions and
    classes at any depth, module and class attributes, attributes assigned from outside a class,
    module names. A function's local variables define nothing."""

    members: dict[str, set[str]] = field(default_factory=dict)
    bases: dict[str, set[str]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)

    def class_members(self, name: str) -> set[str]:
        """Members of the classes called `name`, inherited ones from outrider's classes too."""
        seen, todo, out = set(), [name], set()
        while todo:
            cls = todo.pop()
            if cls in seen or cls not in self.members:
                continue
            seen.add(cls)
            out |= self.members[cls]
            todo += self.bases.get(cls, ())
        return out


def _bound(node: ast.AST) -> list[str]:
    """Names an assignment binds: plain names and attribute names (`self.x`, `param.x`)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    else:
        return []
    out = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List, ast.Starred)):
            targets += t.elts if not isinstance(t, ast.Starred) else [t.value]
        elif isinstance(t, ast.Name):
            out.append(t.id)
        elif isinstance(t, ast.Attribute):
            out.append(t.attr)
    return out


def _scope(body: list[ast.stmt]) -> set[str]:
    """What a module's or a class's own body defines (into if/try blocks, not into functions):
    functions, classes, assigned and annotated names."""
    out: set[str] = set()
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        out.update(_bound(node))
        todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return out


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """`self.x` a method of the class assigns."""
    return {
        t.attr
        for node in ast.walk(cls)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for t in ast.walk(node)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


@functools.lru_cache(maxsize=1)
def _index() -> Index:
    index = Index()
    for path in sorted((ROOT / "outrider").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        index.names |= {path.stem} | _scope(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members = _scope(node.body) | _self_attributes(node)
                index.members.setdefault(node.name, set()).update(members)
                index.names |= members
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                index.bases.setdefault(node.name, set()).update(bases - {""})
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                index.names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                # attributes set from outside a class (`param.weight_loader = ...`)
                index.names.update(t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute))
    return index


def _spans(text: str) -> list[tuple[int, str]]:
    """(line number, inline code) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(n, s.strip()) for s in SPAN.findall(line)]
    return out


def _check_path(path: str, test: str | None) -> str | None:
    """Why `path` (and `path::test`) does not hold, or None."""
    path = path.rstrip(".,;:")
    if "*" in path:
        return None if any(ROOT.glob(path)) else f"{path} matches no file"
    if not (ROOT / path).exists():
        return f"{path} does not exist"
    if test is not None and not re.search(rf"^\s*def {test}\(", (ROOT / path).read_text(), re.M):
        return f"{path} defines no {test}"
    return None


def _check_span(span: str, index: Index) -> str | None:
    """Why inline code `span` names what outrider/ lacks, or None (also for prose in backticks,
    `[B, 1 + k]`, and names too plain to check, `topk`)."""
    if "/" in span or re.search(r"\.(py|md|json|toml|ya?ml)(::\w+)?$", span):
        if FILE_LIKE.match(span) and not PATH.fullmatch(span) and not (ROOT / span).exists():
            return f"{span} is not a file named from the repository root"
        return None  # a path from the root: checked with every other path
    if span.split(".")[0].split("(")[0] in BUILTINS:
        return None  # Python's own (`None`, `dict.get`, `len()`)
    if (m := MEMBER.match(span)) is not None:
        cls, member = m.groups()
        if cls not in index.members:
            return f"no class {cls} in outrider/"
        if member not in index.class_members(cls):
            return f"class {cls} has no member {member}"
        return None
    if CLASS.match(span):
        return None if span in index.members else f"no class {span} in outrider/"
    m = FUNCTION.match(span)
    if m is not None and ("_" in span or m.group(2)) and m.group(1) not in index.names:
        return f"nothing in outrider/ is named {m.group(1)}"
    return None


def problems(text: str) -> list[str]:
    """Every reference in `text` that the code does not hold, as 'line N: what is wrong'."""
    found = []
    for n, line in enumerate(text.splitlines(), start=1):
        for path, test in PATH.findall(line):
            if (why := _check_path(path, test or None)) is not None:
                found.append(f"line {n}: {why}")
    index = _index()
    for n, span in _spans(text):
        if (why := _check_span(span, index)) is not None:
            found.append(f"line {n}: {why}")
    return found


def test_every_path_class_and_member_the_page_names_exists():
    found = problems(DOC.read_text())
    assert found == [], f"docs/architecture.md names what the code lacks: {found}; {FIX}"


def test_the_page_stays_one_page():
    n = len(DOC.read_text().splitlines())
    assert n < MAX_LINES, (
        f"docs/architecture.md has {n} lines, the limit is {MAX_LINES}: move detail into the "
        "module docstrings it points to and keep the page to what a newcomer reads first"
    )


def test_the_checks_read_the_page():
    """The page names many paths and members, so a parser that found nothing would fail here
    rather than pass above."""
    text = DOC.read_text()
    paths = {p for line in text.splitlines() for p, _ in PATH.findall(line)}
    members = [s for _, s in _spans(text) if MEMBER.match(s)]
    assert len(paths) >= 40, sorted(paths)
    assert len(members) >= 20, members
    assert "outrider/executor/spec_step.py" in paths


def test_the_checks_catch_what_a_rename_leaves_behind():
    text = "\n".join(
        [
            "`outrider/engine/speculation.py` and `outrider/engine/speculator.py`.",
            "```",
            "outrider/executor/no_such_step.py",
            "```",
            "`tests/unit/test_import_layers.py::test_imports_run_down_the_house`,",
            "`tests/unit/test_import_layers.py::test_no_such_test`, `benchmarks/results/*.nope`",
            "`executor/spec_step.py`, `[B, 1 + k]`",
            "`Speculator.before_schedule`, `Speculator.before_scheduling`, `NoSuchClass.run`",
            "`SpecStep` and `SpecSteps`; `register_proposer` and `register_a_proposer()`",
            "`Eagle3Drafter.observe` (from the class) and `DeviceDrafter.forget` (inherited)",
            "`SpecStep.padded` (a method's local, no member) and Python's own `None`, `len()`",
        ]
    )
    assert problems(text) == [
        "line 1: outrider/engine/speculator.py does not exist",
        "line 3: outrider/executor/no_such_step.py does not exist",
        "line 6: tests/unit/test_import_layers.py defines no test_no_such_test",
        "line 6: benchmarks/results/*.nope matches no file",
        "line 7: executor/spec_step.py is not a file named from the repository root",
        "line 8: class Speculator has no member before_scheduling",
        "line 8: no class NoSuchClass in outrider/",
        "line 9: no class SpecSteps in outrider/",
        "line 9: nothing in outrider/ is named register_a_proposer",
        "line 11: class SpecStep has no member padded",
    ]
