"""gpu_mon/quickclient.py writes and reads JSON without the json module (its import loads re: a third of a
quick submit): what it writes is what json.dumps writes, what it reads is what json.loads reads, and what
json refuses it refuses."""

from __future__ import annotations

import json
import random

import pytest

from gpu_mon import quickclient

SAMPLES = [
    None,
    True,
    False,
    0,
    -0,
    7,
    -12345678901234567890,
    0.5,
    -0.0,
    1e300,
    2.5e-8,
    "",
    "plain",
    'quote " backslash \\ slash / tab \t newline \n nul \x00 bell \x07',
    "é 漢字 \U0001f600 \u2028",
    [],
    {},
    [1, [2, [3, [4]]], {"a": [None, True]}],
    {"op": "submit", "command": ["sh", "-c", "echo 'x' > \"$HOME/y\""], "env": {"PATH": "/bin"}, "gpus": 2},
    {"ok": True, "id": 17, "elements": [0, 1, 2], "ahead": 0, "state": "held", "error": "can't: é"},
]


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["none", "bool", "int", "float", "str"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-(10**20), 10**20)
    if kind == "float":
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30)
    if kind == "str":
        return "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF)])) for _ in range(8))
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(3)}


@pytest.mark.parametrize("value", SAMPLES)
def test_written_as_json_dumps_writes_it_and_read_as_json_loads_reads_it(value):
    assert quickclient.dumps(value) == json.dumps(value, separators=(",", ":")).encode("ascii")
    text = json.dumps(value, indent=2, ensure_ascii=False).encode("utf-8")  # (spaces and raw UTF-8 too)
    assert quickclient.loads(text) == json.loads(text)


def test_random_values_round_trip_as_json_does():
    rng = random.Random(38)
    for _ in range(500):
        value = _random_value(rng)
        assert quickclient.dumps(value) == json.dumps(value, separators=(",", ":")).encode("ascii")
        assert quickclient.loads(quickclient.dumps(value)) == json.loads(json.dumps(value))


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"{",
        b"[1,]",
        b'{"a" 1}',
        b'{"a":1,}',
        b"01x",
        b"01",
        b"-01",
        b"1.",
        b".5",
        b"1e",
        b"1e+",
        b"--1",
        b"1.5e3.2",
        b"+1",
        b"-",
        b"1.2.3",
        b"tru",
        b'"\x01"',
        b"[1] 2",
        b"\xff",
    ],
)
def test_what_json_refuses_is_refused(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        quickclient.loads(text)


def test_what_only_json_reads_is_read_by_json_and_what_it_cannot_write_is_refused():
    assert quickclient.loads(b'{"a": NaN}')["a"] != quickclient.loads(b'{"a": NaN}')["a"]  # (NaN: by json)
    deep = b"[" * 600 + b"]" * 600  # (deeper than the reader here goes: json reads it)
    assert quickclient.loads(deep) == json.loads(deep)
    with pytest.raises(ValueError):  # (deeper than json goes: a ValueError, as every refusal)
        quickclient.loads(b"[" * 100000 + b"]" * 100000)
    for value in (float("nan"), float("inf"), {1: "a"}, {"a": object()}, b"bytes"):
        with pytest.raises(ValueError):
            quickclient.dumps(value)
