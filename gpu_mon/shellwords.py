"""Split a command line into words as `shlex.split` does (POSIX rules), in linear time.

Written by hand because shlex builds each word one character at a time (`self.token = self.token + c`):
quadratic in the word's length, so a 1 MB `cmd =` took 27 s to parse and stalled a reload. The rules are
shlex's with posix=True and no comments: blanks separate words; '...' is literal; in "..." a backslash
escapes only `"` and `\\`; elsewhere a backslash takes the next character literally; quoted and unquoted
parts next to each other make one word. tests/test_config.py checks it against shlex on random input.
"""

from __future__ import annotations

from typing import List

_BLANKS = " \t\r\n"


def split(text: str) -> List[str]:
    """The words of `text`; ValueError("No closing quotation" / "No escaped character") as shlex."""
    words: List[str] = []
    parts: List[str] = []
    in_word = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _BLANKS:
            if in_word:
                words.append("".join(parts))
                parts, in_word = [], False
            i += 1
            continue
        in_word = True
        if c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise ValueError("No closing quotation")
            parts.append(text[i + 1 : end])
            i = end + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, parts)
        elif c == "\\":
            if i + 1 >= n:
                raise ValueError("No escaped character")
            parts.append(text[i + 1])
            i += 2
        else:
            j = i
            while j < n and text[j] not in _BLANKS and text[j] not in "'\"\\":
                j += 1
            parts.append(text[i:j])
            i = j
    if in_word:
        words.append("".join(parts))
    return words


def _double_quoted(text: str, i: int, parts: List[str]) -> int:
    """Append the inside of a "..." that starts at `i`; return the index after the closing quote."""
    n = len(text)
    while True:
        j = i
        while j < n and text[j] not in '"\\':
            j += 1
        parts.append(text[i:j])
        if j >= n:
            raise ValueError("No closing quotation")
        if text[j] == '"':
            return j + 1
        if j + 1 >= n:
            raise ValueError("No escaped character")
        nxt = text[j + 1]
        parts.append(nxt if nxt in '"\\' else "\\" + nxt)
        i = j + 2
