"""One meaning per name across the library: no two modules of ``flower_strategies`` define the same top-level name,
unless both are the same literal (a wire name two methods share, e.g. a ``"momentum"`` record) or one is the other's
re-export (``X = module.X``).  Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def top_level(path: Path) -> dict[str, ast.AST | None]:
    """``{name: assigned value node (None for a def/class)}`` of a module's own top-level definitions."""
    out: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = None
        elif isinstance(node, ast.Assign):
            out.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node.value
    return out


def clashes(root: Path) -> list[str]:
    """The names defined by two or more modules under ``root`` with different meanings, with their modules."""
    defined: dict[str, list[tuple[str, ast.AST | None]]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for name, value in top_level(path).items():
            if name not in ("__all__", "__version__"):
                defined[name].append((path.relative_to(root.parent).as_posix(), value))
    out = []
    for name, places in defined.items():
        if len(places) < 2:
            continue
        values = [v for _, v in places]
        same_literal = all(isinstance(v, ast.Constant) for v in values) and len({v.value for v in values}) == 1
        reexport = sum(not (isinstance(v, ast.Attribute) and v.attr == name) for v in values) <= 1
        if not (same_literal or reexport):
            out.append(f"{name}: {', '.join(p for p, _ in places)}")
    return out


def test_no_two_library_modules_give_one_name_two_meanings():
    assert clashes(ROOT / "flower_strategies") == []


def test_the_check_sees_a_clash(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def run_rounds(): ...\nKIND = 'x'\nSHARED = 'momentum'\nFOO = 1\n")
    (pkg / "b.py").write_text("import a\n\ndef run_rounds(): ...\nKIND = 'y'\nSHARED = 'momentum'\nFOO = a.FOO\n")
    assert clashes(pkg) == ["run_rounds: pkg/a.py, pkg/b.py", "KIND: pkg/a.py, pkg/b.py"]
