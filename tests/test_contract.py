"""The contract's boundaries: train imports nothing from prep; schemas imports neither."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` names anywhere in the file (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package, forbidden", [("train", ("prep",)), ("schemas", ("prep", "train"))])
def test_package_imports_nothing_from(package, forbidden):
    files = sorted((REPO / package).rglob("*.py"))
    assert len(files) >= 3
    bad = {f"{p.relative_to(REPO)}: {m}" for p in files for m in imported_modules(p)
           if m.split(".")[0] in forbidden}
    assert not bad, f"{package}/ must not import {forbidden}: {sorted(bad)}"


def test_the_walk_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from prep.budget import plan_frames\n    import prep.probe\n")
    assert imported_modules(f) == {"prep.budget", "prep.probe"}
