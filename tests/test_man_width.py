"""Every man page reads on an 80-column terminal: no rendered line, examples (no-fill blocks) included,
passes 80 columns (groff fills the prose to the width; an example line is as long as it is written)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAN_PAGES = sorted((ROOT / "docs" / "man").glob("*.[1-8]"))
COLUMNS = 80


@pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff")
@pytest.mark.parametrize("page", MAN_PAGES, ids=lambda p: p.name)
def test_no_line_of_a_man_page_passes_80_columns(page: Path) -> None:
    r = subprocess.run(
        ["groff", "-man", "-Tascii", f"-rLL={COLUMNS}n", "-P-cbu", str(page)],
        capture_output=True,
        text=True,
        check=True,
    )
    long = [line for line in r.stdout.splitlines() if len(line) > COLUMNS]
    assert long == [], f"{page.name}: {len(long)} lines over {COLUMNS} columns:\n" + "\n".join(long)
