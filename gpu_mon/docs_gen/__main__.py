"""`python -m gpu_mon.docs_gen [--check] [ROOT]`: write docs/man/gpu-mon.1 and docs/completion/ under ROOT
(default: this checkout); --check writes nothing, names each stale file and exits 1."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

from gpu_mon.reference import completion, manpage, model


def generated() -> Dict[str, str]:
    """Each generated file (path under the checkout) and its text."""
    from gpu_mon.cli import build_parser

    top = model.command(build_parser())
    files = {"docs/man/gpu-mon.1": manpage.render(top)}
    for shell in completion.SHELLS:
        files[f"docs/completion/{completion.FILES[shell]}"] = completion.script(shell, top)
    return files


def main(argv: Optional[List[str]] = None) -> int:
    """Write (or --check) the files; the exit code."""
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    rest = [a for a in args if a != "--check"]
    root = Path(rest[0]) if rest else Path(__file__).resolve().parents[2]
    stale = []
    for name, text in generated().items():
        path = root / name
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for name in stale:
        print(f"{name}: {'out of date (run python -m gpu_mon.docs_gen)' if check else 'written'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
