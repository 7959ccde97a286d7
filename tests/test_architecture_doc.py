"""docs/ARCHITECTURE.md is drawn from the code: its tree of gpu_mon/ names every module there is, and no
module that is gone."""

from __future__ import annotations

import re

from conftest import ROOT

DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _tree() -> set:
    """The files the doc's tree names, as paths under gpu_mon/ (`engine/round.py`)."""
    text = DOC.read_text()
    block = text.split("```\ngpu_mon/\n", 1)[1].split("```", 1)[0]
    named, dirs = set(), []  # dirs: (indent, name) of the directories around the current line
    for line in block.splitlines():
        m = re.match(r"^( +)([\w.]+(?:/|\.py))(?:\s|$)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while dirs and dirs[-1][0] >= indent:
            dirs.pop()
        path = "/".join([d for _i, d in dirs] + [name.rstrip("/")])
        if name.endswith("/"):
            dirs.append((indent, name.rstrip("/")))
        else:
            named.add(path)
    return named


def _modules() -> set:
    pkg = ROOT / "gpu_mon"
    return {
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if p.name != "__init__.py" or p.parent == pkg  # (a package's own file: only the top one has code)
    }


def test_the_architecture_doc_names_every_module_and_no_other():
    named, modules = _tree(), _modules()
    assert sorted(modules - named) == [], "modules the doc's tree does not name"
    assert sorted(named - modules) == [], "the doc's tree names modules that do not exist"
