"""Checks over vframe's own source that no test run on this CPU machine would make.

A name imported under ``if TYPE_CHECKING:`` exists for annotations only; used in a
function body it raises ``NameError`` when that line runs. Lines that run only on a GPU
(``RunnerInfo.of`` on CUDA did, stopping every CUDA engine start) pass every CPU test, so
this looks for such uses in the source instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def type_checking_names_used_at_run_time(source: str) -> list[tuple[int, str, str]]:
    """``(line, name, function)`` for each load of a ``TYPE_CHECKING``-only import in a
    function body that neither imports the name itself nor uses it as an annotation."""
    tree = ast.parse(source)
    guarded: set[str] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (getattr(test, "id", None), getattr(test, "attr", None)):
            for stmt in node.body:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    guarded.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    if not guarded:
        return []
    in_annotations = {
        id(sub)
        for node in ast.walk(tree)
        for attr in ("annotation", "returns")
        if getattr(node, attr, None) is not None
        for sub in ast.walk(getattr(node, attr))
    }
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local = {
            (a.asname or a.name).split(".")[0]
            for n in ast.walk(fn)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        }
        for n in ast.walk(fn):
            if (
                isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load)
                and n.id in guarded - local
                and id(n) not in in_annotations
            ):
                found.append((n.lineno, n.id, fn.name))
    return found


def test_the_check_finds_a_type_checking_import_used_at_run_time() -> None:
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
        "def annotated(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x\n"
        "def imports_it():\n"
        "    import torch\n"
        "    return torch.zeros(1)\n"
        "def forgets_it(device):\n"
        "    return torch.cuda.get_device_properties(device)\n"
    )
    assert type_checking_names_used_at_run_time(source) == [(11, "torch", "forgets_it")]


def test_no_type_checking_import_is_used_at_run_time() -> None:
    files = sorted([*ROOT.joinpath("vframe").rglob("*.py"), *ROOT.joinpath("contrib").rglob("*.py")])
    assert len(files) > 100
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name} in {fn}()"
        for path in files
        for line, name, fn in type_checking_names_used_at_run_time(path.read_text())
    ]
    assert found == []
