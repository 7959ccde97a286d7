"""`--after` as Slurm's --dependency writes it: `afterok:17:18`, `afterany:17_5`, `afternotok:17`, a plain
`17` (afterok), combined with commas. Standard library only: the quick submit path (commands/quicksubmit.py)
parses with it too, so both send the same request.

On the wire (a submit's or an update's "after"): a list, a plain id for afterok as before (17, or "17_5"
for an element), else "KIND:REF" (`"afterany:17"`, `"afternotok:17_5"`).
"""

from __future__ import annotations

TYPE_CHECKING = False  # (typing alone takes 5-10 ms to import: the quick submit path does without)
if TYPE_CHECKING:
    from typing import List, Tuple, Union

    Ref = Union[int, str]

AFTEROK, AFTERANY, AFTERNOTOK = "afterok", "afterany", "afternotok"
KINDS = (AFTEROK, AFTERANY, AFTERNOTOK)
MAX_REFS = 1000  # ids one --after may name


def _shown(text: str) -> str:
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def _ref(text: str) -> Ref:
    """`17` as a number, `17_5` as it is (1 to 9 digits each, as queue/arrays.py's ids); ValueError."""
    job, under, index = text.strip().partition("_")

    def number(t: str) -> bool:
        return 0 < len(t) <= 9 and t.isascii() and t.isdigit()

    if not number(job) or int(job) < 1 or (under and not number(index)):
        raise ValueError(f"--after: {_shown(text)} is not a job id (17, or 17_5 for an array's element)")
    return f"{int(job)}_{int(index)}" if under else int(job)


def parse(text: str) -> List[Ref]:
    """--after's text as the request's list; ValueError (one line) for anything else."""
    out: List[Ref] = []
    for part in text.split(",") if text else []:
        if not part.strip():
            continue
        kind, colon, rest = part.strip().partition(":")
        if not colon:
            out.append(_ref(kind))
            continue
        if kind.lower() not in KINDS:
            known = ", ".join(KINDS)
            raise ValueError(f"--after: {_shown(kind)} is not a dependency kind ({known}; or a plain id)")
        for ref in rest.split(":"):
            value = _ref(ref)
            out.append(value if kind.lower() == AFTEROK else f"{kind.lower()}:{value}")
    if len(out) > MAX_REFS:
        raise ValueError(f"--after names {len(out)} jobs (at most {MAX_REFS})")
    return out


def split(item: object) -> Tuple[str, object]:
    """A request's item: its kind and its reference (17, "17", "17_5"); a plain one is afterok. ValueError
    for a kind that is not one."""
    if isinstance(item, str) and ":" in item:
        kind, _, ref = item.partition(":")
        if kind not in KINDS:
            raise ValueError(f"--after: {_shown(kind)} is not a dependency kind ({', '.join(KINDS)})")
        return kind, ref
    return AFTEROK, item
