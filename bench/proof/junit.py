"""What a pytest run of GPU-marked tests says: each test's outcome and the figures it recorded
(`record_property`), read from its JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict


def first_line(text: str) -> str:
    """The first non-empty line of a message."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def outcome(case: ET.Element) -> str:
    """passed, or failed/error/skipped with the first line of why."""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            word = {"failure": "failed"}.get(tag, tag)
            return f"{word}: {first_line(node.get('message') or node.text or '')}"
    return "passed"


def number(text: str) -> Any:
    """A recorded figure: a float where it is one, else the text."""
    try:
        return float(text)
    except ValueError:
        return text


def read(path: Path) -> Dict[str, Any]:
    """{"outcomes": {test: outcome}, figure: value, ...}; empty when the file is missing or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    result: Dict[str, Any] = {"outcomes": {}}
    for case in root.iter("testcase"):
        result["outcomes"][case.get("name", "?")] = outcome(case)
        for prop in case.iter("property"):
            result[prop.get("name", "?")] = number(prop.get("value", ""))
    return result
