"""Job arrays, pure: `submit --array SPEC` as Slurm writes it (`0-199`, `1,3,5-9`, `0-99:5`, `0-199%8`), an
array's indices written back as ranges (`8-199`, `1,3,5-9`), `--output`'s patterns (%A %a %j), and an
array's elements by index as the store keeps them (Members).

The parser never builds more than it may keep: the spec's length, each number's digits and the count of
elements are checked before any index list is made, so `0-99999999` or a megabyte of commas costs nothing.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, List, MutableMapping, Optional, Sequence, Tuple

MAX_SPEC = 64 * 1024  # characters of a SPEC (an explicit list of 10 000 indices fits)
_NUMBER = re.compile(r"^[0-9]{1,9}$")
_PATTERN = re.compile(r"%[%Aaj]")


class SpecError(ValueError):
    """A SPEC that is refused; str() is one line."""


@dataclass(frozen=True, eq=False)
class ArraySpec:
    """The indices an array has (sorted, each once: a range for a spec of one item, else a tuple) and how
    many of its elements may run at once (0: any). Equal to another with the same indices and limit."""

    indices: Sequence[int]
    limit: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArraySpec):
            return NotImplemented
        return (tuple(self.indices), self.limit) == (tuple(other.indices), other.limit)

    def __hash__(self) -> int:
        return hash((tuple(self.indices), self.limit))


def _number(text: str, what: str) -> int:
    if not _NUMBER.match(text):
        raise SpecError(f"{what} {_shown(text)!s} is not a whole number")
    return int(text)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 20 else text[:20] + "...")


def _item(text: str, max_size: int) -> range:
    """One item: `A`, `A-B` or `A-B:S`, as a range of indices (each below max_size)."""
    if not text:
        raise SpecError("an empty item (two commas, or a comma at an end)")
    step = 1
    if ":" in text:
        text, _, step_text = text.partition(":")
        step = _number(step_text, "the step")
        if step < 1:
            raise SpecError("the step must be at least 1")
    first_text, dash, last_text = text.partition("-")
    first = _number(first_text, "index")
    last = _number(last_text, "index") if dash else first
    if last < first:
        raise SpecError(f"range {first}-{last} ends before it starts")
    if last >= max_size:
        raise SpecError(f"index {last} is over the largest allowed, {max_size - 1} ([queue] max_array_size)")
    if step != 1 and not dash:
        raise SpecError(f"a step needs a range ({_shown(text)})")
    return range(first, last + 1, step)


def parse(spec: str, max_size: int) -> ArraySpec:
    """`0-199%8` -> indices 0..199, at most 8 running; SpecError (one line) for anything else."""
    if not isinstance(spec, str):
        raise SpecError("the array spec must be text")
    if len(spec) > MAX_SPEC:
        raise SpecError(f"the array spec is too long ({len(spec)} characters; at most {MAX_SPEC})")
    body, percent, limit_text = spec.strip().partition("%")
    limit = 0
    if percent:
        limit = _number(limit_text, "the %N limit")
        if limit < 1:
            raise SpecError("the %N limit must be at least 1")
    if not body:
        raise SpecError("no indices given (e.g. 0-99, 1,3,5-9, 0-99:5, 0-99%8)")
    return ArraySpec(_indices(_items(body, max_size)), limit)


def _items(body: str, max_size: int) -> List[range]:
    """The items of a SPEC without its %N, as ranges (nothing built per index): at most max_size indices
    in all, each below it."""
    ranges: List[range] = []
    count = 0
    for part in body.split(","):
        r = _item(part, max_size)
        count += len(r)
        if count > max_size:
            raise SpecError(f"more than {max_size} elements ([queue] max_array_size)")
        ranges.append(r)
    return ranges


def _indices(ranges: List[range]) -> Sequence[int]:
    return ranges[0] if len(ranges) == 1 else tuple(sorted({i for r in ranges for i in r}))


def as_range(indices: Sequence[int]) -> Optional[range]:
    """The indices as a range, when they are one (increasing, evenly spaced): how an array keeps them."""
    if isinstance(indices, range) or not indices:
        return indices if isinstance(indices, range) and indices.step > 0 and indices else None
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    span = range(indices[0], indices[-1] + 1, step) if step > 0 else range(0)
    return span if len(span) == len(indices) and all(map(int.__eq__, span, indices)) else None


def ranges(indices: Iterable[int]) -> str:
    """Sorted indices as a SPEC: `0-3,7,9-10` (`jobs` shows an array's elements in one state so)."""
    out: List[str] = []
    start: Optional[int] = None
    prev = -2
    for i in sorted(indices):
        if i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(out)


def expand_output(pattern: str, job_id: int, array_id: int, index: Optional[int]) -> str:
    """--output's `%A` (the array's id; the job's own outside an array), `%a` (the index; 0 outside an
    array), `%j` (the job's id) and `%%` (a percent sign), as Slurm's are."""
    if "%" not in pattern:
        return pattern
    values = {"%%": "%", "%A": str(array_id or job_id), "%a": str(index or 0), "%j": str(job_id)}
    return _PATTERN.sub(lambda m: values[m.group(0)], pattern)


def parse_ref(text: str) -> Tuple[int, Optional[int]]:
    """A job reference as users write it: `17` (a job, or a whole array) or `17_5` (one element):
    (17, None) or (17, 5). ValueError when it is neither."""
    head, under, tail = str(text).strip().partition("_")
    if not _NUMBER.match(head) or int(head) < 1 or (under and not _NUMBER.match(tail)):
        raise ValueError(f"{_shown(str(text))} is not a job id (17, or 17_5 for an array's element)")
    return int(head), (int(tail) if under else None)


def is_range(text: object) -> bool:
    """Whether a job reference names a range of an array's elements (`17_[0-3,8]`), as Slurm's scancel
    takes them."""
    return isinstance(text, str) and "_[" in text


def parse_range(text: str, max_size: int, build: bool = True) -> Tuple[int, Sequence[int]]:
    """`17_[0-3,8]` -> (17, (0, 1, 2, 3, 8)): the elements of array 17 that a range names, in a SPEC as
    --array takes it without its %N. What it builds is bounded before it is made, as parse()'s: every
    index below max_size ([queue] max_array_size), at most max_size of them; `build=False` only checks
    it (the client, which does not know the daemon's limit: nothing per index made). SpecError (one line,
    naming the reference) for anything else."""
    shown = _shown(text)
    if len(text) > MAX_SPEC:
        raise SpecError(f"{shown}: too long ({len(text)} characters; at most {MAX_SPEC})")
    head, _, rest = text.strip().partition("_[")
    if not _NUMBER.match(head) or int(head) < 1:
        raise SpecError(f"{shown}: {_shown(head)} is not a job id (17_[0-3,8]: elements of array 17)")
    if not rest.endswith("]"):
        raise SpecError(f"{shown}: a range ends with ] (17_[0-3,8])")
    body = rest[:-1]
    if not body:
        raise SpecError(f"{shown}: no indices given (17_[0-3,8])")
    if "%" in body or "[" in body or "]" in body:
        raise SpecError(f"{shown}: a range takes indices only (0-3,8; 0-99:5)")
    try:
        items = _items(body, max_size)
    except SpecError as err:
        raise SpecError(f"{shown}: {err}") from None
    return int(head), _indices(items) if build else range(0)


def range_text(job_id: int, indices: Sequence[int]) -> str:
    """A range as users write it (`17_[0-3,8]`)."""
    return f"{job_id}_[{ranges(indices)}]"


class Members(MutableMapping[int, int]):
    """An array's elements by index, as the store finds them (index -> job id), kept as the array is:
    ids from `first` (the array's), in the order of `order` (increasing indices: a range, or a sorted
    tuple), but the indices in `gone` (removed since). Nothing is kept per element (a dict: 30 bytes an
    element, 1.5 MB for 50 000)."""

    __slots__ = ("first", "gone", "order")

    def __init__(self, first: int, order: Sequence[int], gone: Iterable[int] = ()) -> None:
        self.first, self.order = first, order
        self.gone = set(gone)

    def _position(self, index: object) -> int:
        """Where `index` is in `order`; -1 when it is not there, or is gone."""
        return -1 if index in self.gone else self._place(index)

    def _place(self, index: object) -> int:
        """Where `index` is in `order` (gone or not); -1 when it is not there."""
        if not isinstance(index, int):
            return -1
        order = self.order
        if isinstance(order, range):
            return order.index(index) if index in order else -1
        at = bisect.bisect_left(order, index)
        return at if at < len(order) and order[at] == index else -1

    def __getitem__(self, index: int) -> int:
        at = self._position(index)
        if at < 0:
            raise KeyError(index)
        return self.first + at

    def __setitem__(self, index: int, job_id: int) -> None:
        """An element back (only where its id says it is: the store never moves one)."""
        at = self._place(index)
        if at < 0 or self.first + at != job_id:
            raise ValueError(f"element {index} of array {self.first} cannot be job {job_id}")
        self.gone.discard(index)

    def __delitem__(self, index: int) -> None:
        if self._position(index) < 0:
            raise KeyError(index)
        self.gone.add(index)

    def __iter__(self) -> Iterator[int]:
        gone = self.gone
        return (i for i in self.order if i not in gone) if gone else iter(self.order)

    def __len__(self) -> int:
        return len(self.order) - len(self.gone)

    def __repr__(self) -> str:
        return f"Members({self.first}, {self.order!r}, gone={sorted(self.gone)!r})"
