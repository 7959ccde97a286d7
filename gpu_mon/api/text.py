"""Untrusted text (process, user and GPU names, commands, paths, workload output) made safe for one line of
a log, a terminal or the systemd status: control characters, C1 codes, line and paragraph separators and
the invisible format characters (bidi overrides such as U+202E, zero-width joiners) are spelled out, so a
name can neither forge a line, drive a terminal, nor reorder what an admin reads."""

from __future__ import annotations

import unicodedata

_UNSAFE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def sanitize(text: str, limit: int = 200) -> str:
    """The text with every unsafe character escaped, cut after `limit` characters ('...' marks a cut)."""
    head = text[:limit]
    if head.isascii() and head.isprintable():
        out = head
    else:
        out = "".join(
            ch if ch.isprintable() and unicodedata.category(ch) not in _UNSAFE_CATEGORIES else _escape(ch)
            for ch in head
        )
    return out + "..." if len(text) > limit else out


def sanitize_lines(text: str, limit: int = 4096) -> str:
    """Each line of a multi-line text sanitized on its own (newlines kept)."""
    return "\n".join(sanitize(line, limit) for line in text.split("\n"))
