"""README.md is the entry to the docs and the docs hold together: every relative link of README.md and
docs/*.md resolves (to a file, and for `#anchor` to a heading of it), README links every page of docs/ and
every man page, README stays short, and every `gpu-mon ...` command line of their ```sh blocks parses with
gpu-mon's own parser (a renamed command or option breaks this test, not a reader)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from gpu_mon.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # (not docs/_incoming/: drafts, not yet placed)
MAN_PAGES = sorted((ROOT / "docs" / "man").glob("*.[1-8]"))
README_MAX_LINES = 400

FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def rel(path: Path) -> str:
    """A path as the repository names it."""
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """Markdown without its fenced blocks and code spans (a `](x)` in code is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(page: Path) -> List[str]:
    """The targets of a page's links and images, as written."""
    return LINK.findall(prose(page.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (code and link markup dropped), lower case, punctuation
    other than '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    """Every heading's anchor in a Markdown file (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: Dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), re.M):
        base = slug(m.group(1))
        out.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return out


def resolve(page: Path, target: str) -> Tuple[Path, str]:
    """A relative link of a page: the file it names (the page itself for `#x`) and its anchor."""
    path, _, anchor = target.partition("#")
    return (page.parent / path).resolve() if path else page, anchor


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if SCHEME.match(target):
            continue
        dest, anchor = resolve(page, target)
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


def test_readme_links_every_page_of_docs_and_names_the_man_pages() -> None:
    linked = {resolve(README, t)[0] for t in links(README) if not SCHEME.match(t)}
    pages = [p for p in PAGES if p != README]
    assert {p.name for p in pages} >= {"admin-guide.md", "users-guide.md", "operations.md", "ARCHITECTURE.md"}
    assert [rel(p) for p in pages if p.resolve() not in linked] == []
    assert {p.name for p in MAN_PAGES} >= {"gpu-mon.1", "gpu_mon.conf.5", "gpu-mon-queue.7"}
    text = README.read_text()
    for page in MAN_PAGES:
        assert page.resolve() in linked, f"README does not link {rel(page)}"
        assert f"`man -l {rel(page)}`" in text, f"README does not say how to read {rel(page)} from a checkout"
        assert f"`man {page.stem}`" in text, f"README does not say how to read {page.name} once installed"


def test_readme_is_at_most_400_lines() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


# ------------------------------------------------------------------ the documented commands parse

SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.M | re.S)
OPERATORS = {"&&", "||", "|", ";", "&", "(", ")", "|&", ";;"}
REDIRECTS = {"<", ">", ">>", ">&", "<<", "&>"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]+$|\.\.\.")


def shell_commands(line: str) -> Iterator[List[str]]:
    """A shell line's simple commands, as word lists (redirections and their targets left out)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.commenters = "#"
    lexer.whitespace_split = True
    words: List[str] = []
    skip = False
    for word in lexer:
        if skip:
            skip = False
        elif word in OPERATORS:
            yield words
            words = []
        elif word in REDIRECTS:
            skip = True
        else:
            words.append(word)
    yield words


def gpu_mon_args(words: List[str]) -> List[str]:
    """The arguments of a simple command that runs gpu-mon (after `NAME=value`s, `sudo`, `runuser ... --`),
    else []."""
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] == "sudo"):
        words = words[1:]
    if words[:1] == ["runuser"] and "--" in words:
        words = words[words.index("--") + 1 :]
    return words[1:] if words and os.path.basename(words[0]) == "gpu-mon" else []


def documented_commands() -> Tuple[List[Tuple[str, List[str]]], List[str]]:
    """Every `gpu-mon ...` command of the ```sh blocks of README.md and docs/*.md, as (where, arguments),
    and the lines left out because they hold a placeholder."""
    found, skipped = [], []
    for page in PAGES:
        for block in SH_BLOCK.finditer(page.read_text()):
            for line in block.group(1).replace("\\\n", " ").splitlines():
                for words in shell_commands(line):
                    args = gpu_mon_args(words)
                    if not args:
                        continue
                    if any(PLACEHOLDER.search(w) for w in args):
                        skipped.append(f"{rel(page)}: {line.strip()}")
                    else:
                        found.append((f"{rel(page)}: {line.strip()}", args))
    return found, skipped


def test_every_documented_gpu_mon_command_parses() -> None:
    """Each `gpu-mon ...` command of a ```sh block of README.md or docs/*.md (also as `.venv/bin/gpu-mon`,
    after `sudo`, `NAME=value` or `runuser -u USER --`, and each one of a line's `&&`/`|`/`;` commands) is
    given to gpu-mon's own parser, as `gpu-mon` would be: a renamed command or option, or a value the
    parser refuses, fails here. The rule for what is left out: a command with a placeholder for the reader
    to fill in, a word of capitals and '_' alone (CONF, ID, CMD, PATH...) or '...', is not parsed (name a
    signal USR1 or SIGUSR1, as the docs do, not TERM); a word in another case is taken as written."""
    found, skipped = documented_commands()
    assert len(found) >= 25, f"only {len(found)} documented commands found: is the block syntax still ```sh?"
    assert len(skipped) <= len(found) // 4, f"too many commands skipped as placeholders: {skipped}"
    failures = []
    for where, args in found:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(args)
        except SystemExit as stop:
            if stop.code not in (0, None):
                failures.append(f"{where}\n    {err.getvalue().strip().splitlines()[-1]}")
    assert not failures, "documented commands that gpu-mon refuses:\n" + "\n".join(failures)
