"""No function or method in the package is over 60 lines (from its `def` to its last line): argument and
completion tables are data, not code, and a long function is split where its steps are."""

from __future__ import annotations

import ast

from conftest import ROOT

LIMIT = 60


def test_no_function_is_over_60_lines():
    long = []
    for path in sorted((ROOT / "gpu_mon").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
