"""Lexing: the lines of one file -> its sections of (key, value, line, file).

`[section]` headers; `key = value` (or `key: value`); full-line comments with `;` or `#`; an indented line
continues the previous value. Keys are case-insensitive. Only a newline ends a line (CRLF tolerated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

# C0/C1 controls (tab allowed), DEL and the Unicode line/paragraph separators: never meaningful in a config
# line, and echoed raw they would garble the one-line error messages.
CONTROL_RE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


class Item(NamedTuple):
    """One `key = value`, with where it is written."""

    key: str
    value: str
    line: int
    path: str


@dataclass
class RawSection:
    """A section's header line and its items, as written (a drop-in's items are added to it by load)."""

    name: str
    line: int
    path: str
    items: List[Item] = field(default_factory=list)
    more: Dict[int, List[str]] = field(default_factory=dict)  # item index -> its continuation lines

    def join(self) -> None:
        """Put continuation lines into their values (once, at the end: joining per line is quadratic)."""
        for index, lines in self.more.items():
            item = self.items[index]
            self.items[index] = item._replace(value="\n".join([item.value, *lines]).strip())
        self.more = {}


def lex(text: str, path: str, errors: List[str], bad_lines: Dict[int, str]) -> List[RawSection]:
    """Split into sections; lines with control characters go to `bad_lines` (line -> error)."""
    lexer = _Lexer(path, errors, bad_lines)
    # Only "\n" ends a line (CRLF tolerated): str.splitlines() would also split on form feeds, U+2028 and
    # others, and every line number after one would be wrong.
    for lineno, raw in enumerate(text.split("\n"), start=1):
        lexer.line(lineno, raw[:-1] if raw.endswith("\r") else raw)
    for section in lexer.sections:
        section.join()
    return lexer.sections


class _Lexer:
    """Line by line: headers, `key = value` items, continuation lines."""

    def __init__(self, path: str, errors: List[str], bad_lines: Dict[int, str]):
        self.path, self.errors, self.bad_lines = path, errors, bad_lines
        self.sections: List[RawSection] = []
        self.seen: Dict[str, int] = {}  # section name -> line
        self.keys_seen: Dict[str, int] = {}  # key -> line, in the current section
        self.current: Optional[RawSection] = None
        self.header_seen = False  # a '[...' line was met, even a broken one
        self.last_item: Optional[int] = None  # index into current.items that an indented line continues

    def line(self, lineno: int, raw: str) -> None:
        """One line (without its newline)."""
        stripped = raw.strip()
        if not stripped or stripped[0] in ";#":
            return
        bad = CONTROL_RE.search(raw)
        if bad:  # reported alone: the errors that its mangled text causes are dropped in parse()
            self.bad_lines[lineno] = (
                f"{self.where(lineno)}: control character U+{ord(bad.group()):04X} in the line (not allowed)"
            )
            raw = CONTROL_RE.sub("\ufffd", raw)
            stripped = raw.strip()
        if raw[0] in " \t" and self.current is not None and self.last_item is not None:
            self.current.more.setdefault(self.last_item, []).append(stripped)
            return
        self.last_item = None
        if stripped.startswith("["):
            self.header(lineno, stripped)
        else:
            self.item(lineno, stripped)

    def header(self, lineno: int, stripped: str) -> None:
        """A `[section]` line."""
        self.header_seen = True
        self.current = None
        if not stripped.endswith("]"):
            what = (
                "text after the section header's ']' (comments go on their own line)"
                if "]" in stripped
                else "section header is missing its closing ']'"
            )
            self.errors.append(f"{self.where(lineno)}: {what}")
            return
        name = stripped[1:-1].strip()
        if name in self.seen:
            self.errors.append(
                f"{self.where(lineno)}: [{name}] appears twice (first at line {self.seen[name]})"
            )
            return
        self.seen[name] = lineno
        self.keys_seen = {}
        self.current = RawSection(name, lineno, self.path)
        self.sections.append(self.current)

    def item(self, lineno: int, stripped: str) -> None:
        """A `key = value` (or `key: value`) line."""
        cut = [i for i in (stripped.find("="), stripped.find(":")) if i > 0]
        if not cut:
            self.errors.append(
                f"{self.where(lineno)}: expected 'key = value' or '[section]', found {stripped[:60]!r}"
            )
            return
        if self.current is None:
            if not self.header_seen:
                self.errors.append(f"{self.where(lineno)}: 'key = value' before any [section]")
            return  # inside a broken or duplicate section: already reported
        i = min(cut)
        key = stripped[:i].strip().lower()
        if key in self.keys_seen:
            first = self.keys_seen[key]
            self.errors.append(
                f"{self.where(lineno)}: [{self.current.name}] {key}: set twice (first at line {first})"
            )
            return
        self.keys_seen[key] = lineno
        self.current.items.append(Item(key, stripped[i + 1 :].strip(), lineno, self.path))
        self.last_item = len(self.current.items) - 1

    def where(self, lineno: int) -> str:
        """`PATH:LINE`."""
        return f"{self.path}:{lineno}"
