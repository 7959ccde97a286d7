"""What the schema is made of: a Key (name, type, default, doc, example) and a section's spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

# The config file's directory -> the parser of a key's value (only paths use the directory).
ParserFor = Callable[[str], Callable[[str], object]]


@dataclass(frozen=True)
class Key:
    """One key of a section: its parser and what the man page and conf/gpu_mon.conf say about it."""

    name: str
    type: str  # what values it takes, in words ("seconds, at least 0.1")
    parser: ParserFor
    default: str  # as it would be written; "" when unset by default (or required: see `required`)
    doc: str  # one paragraph
    example: str = ""  # a value worth showing besides the default
    required: bool = False


@dataclass(frozen=True)
class SectionSpec:
    """A kind of section: `defaults`, or `gpu-NAME` for every [gpu-*] section."""

    name: str
    doc: str  # one paragraph
    keys: Tuple[Key, ...]

    @property
    def header(self) -> str:
        """`[defaults]`, `[gpu-NAME]`."""
        return f"[{self.name}]"

    def key(self, name: str) -> Key:
        """The key called `name` (KeyError if it has none)."""
        for key in self.keys:
            if key.name == name:
                return key
        raise KeyError(name)


def plain(parse: Callable[[str], object]) -> ParserFor:
    """A key whose value does not depend on where the config file is."""
    return lambda _base: parse
