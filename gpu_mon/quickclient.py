"""The queue socket's client end for the commands answered before the CLI is imported (gpu_mon/entry.py:
`_job-ids` for a TAB, a common `submit`): one framed JSON request (a 4-byte big-endian length, then the
body; queue/protocol.py is the daemon's and the CLI's side) and its answer, with the standard library's
C socket module and struct alone (socket.py's enums take ~4 ms to build; typing 5-10 ms)."""

from __future__ import annotations

import struct

try:
    import _socket as socket
except ImportError:  # (not CPython)
    import socket  # type: ignore[no-redef]

DEFAULT_SOCKET = "/run/gpu_mon/queue.sock"  # = [queue] socket's default (a test checks)
DEFAULT_CONFIG = "/etc/gpu_mon.conf"  # = gpu_mon.config.DEFAULT_PATH (a test checks)
HEADER = struct.Struct(">I")


class NotSent(Exception):
    """Nothing was sent: nothing listens on the socket (or it cannot be reached)."""


class Failed(Exception):
    """After the request was sent: why no answer came (one line), and the exit status the CLI gives it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def exchange(path: str, body: bytes, timeout: float, max_answer: int) -> bytes:
    """Send `body` as one frame on the socket at `path`; return the answer's body."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            raise NotSent(path) from None
        try:
            sock.sendall(HEADER.pack(len(body)) + body)
            return _answer(sock, path, max_answer)
        except socket.timeout:
            raise Failed(f"the daemon on {path} did not answer within {timeout:g} s", 1) from None
        except OSError as err:
            raise Failed(f"the daemon on {path}: {err.strerror or err}", 1) from None
    finally:
        sock.close()


def _answer(sock: socket.socket, path: str, max_answer: int) -> bytes:
    data = bytearray()
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        if len(data) >= HEADER.size and HEADER.unpack_from(data)[0] > max_answer:
            size = HEADER.unpack_from(data)[0]
            raise Failed(f"frame too large ({size} bytes; at most {max_answer})", 2)
        chunk = sock.recv(1 << 18)
        if not chunk:
            raise Failed(f"the daemon on {path} closed the connection without an answer", 1)
        data += chunk
    return bytes(data[HEADER.size : HEADER.size + HEADER.unpack_from(data)[0]])


# ------------------------------------------------------------------ JSON without the json module
# `import json` loads re, enum and functools: 9 ms of a 23 ms `gpu-mon submit` on a 2-core VM, where
# Python's own start is 14. The requests are small and the answers our daemon's, so they are written and
# read here with _json's C string functions; anything else goes to the json module.

try:
    from _json import encode_basestring_ascii as _quote
    from _json import scanstring as _scanstring
except ImportError:  # (not CPython)
    _quote = _scanstring = None  # type: ignore[assignment]

_SPACE = " \t\n\r"
_WORDS = (("true", True), ("false", False), ("null", None))
_NUMBER = frozenset("+-0123456789.eE")


def dumps(obj: object) -> bytes:
    """`obj` as json.dumps(obj, separators=(",", ":")) writes it, in ASCII."""
    if _quote is None:
        import json

        return json.dumps(obj, separators=(",", ":")).encode("ascii")
    out: list = []
    _write(obj, out)
    return "".join(out).encode("ascii")


def _write(v: object, out: list) -> None:
    if v is None or v is True or v is False:
        out.append("null" if v is None else "true" if v else "false")
    elif isinstance(v, str):
        out.append(_quote(v))
    elif isinstance(v, int):
        out.append(int.__repr__(v))
    elif isinstance(v, float) and v == v and v not in (float("inf"), float("-inf")):
        out.append(float.__repr__(v))
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, item in enumerate(v):
            out.append("," if i else "")
            _write(item, out)
        out.append("]")
    elif isinstance(v, dict) and all(isinstance(k, str) for k in v):
        out.append("{")
        for i, (key, item) in enumerate(v.items()):
            out.append(("," if i else "") + _quote(key) + ":")
            _write(item, out)
        out.append("}")
    else:
        raise ValueError(f"not written as JSON here: {type(v).__name__}")


def loads(data: bytes) -> object:
    """The JSON value in `data` (ValueError if it is none); what the small reader here does not take
    (NaN, a nesting too deep) is read by the json module."""
    try:
        text = data.decode("utf-8")
        if _scanstring is None:
            raise ValueError("no _json")
        value, end = _value(text, _skip(text, 0))
        if _skip(text, end) != len(text):
            raise ValueError("extra data")
        return value
    except (ValueError, IndexError, RecursionError):
        import json

        try:
            return json.loads(data)
        except RecursionError:
            raise ValueError("JSON nested too deep") from None


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _SPACE:
        i += 1
    return i


def _value(s: str, i: int) -> tuple:
    c = s[i]
    if c == '"':
        return _scanstring(s, i + 1, True)
    if c == "{":
        return _object(s, _skip(s, i + 1))
    if c == "[":
        return _array(s, _skip(s, i + 1))
    for word, value in _WORDS:
        if s.startswith(word, i):
            return value, i + len(word)
    j = i
    while j < len(s) and s[j] in _NUMBER:
        j += 1
    number = s[i:j]
    if not _json_number(number):
        raise ValueError(f"not JSON at {i}")
    return (float(number) if any(c in "eE." for c in number) else int(number)), j


def _json_number(text: str) -> bool:
    """JSON's grammar: -?(0|[1-9]digits)(.digits)?([eE][+-]?digits)?"""
    body = text[1:] if text.startswith("-") else text
    mantissa, e, exponent = body.replace("E", "e").partition("e")
    whole, dot, part = mantissa.partition(".")
    exponent = exponent[1:] if exponent[:1] in ("+", "-") else exponent
    digits = [whole, *([part] if dot else []), *([exponent] if e else [])]
    return all(d.isdigit() for d in digits) and (whole == "0" or whole[:1] != "0")


def _object(s: str, i: int) -> tuple:
    out: dict = {}
    if s[i] == "}":
        return out, i + 1
    while True:
        if s[i] != '"':
            raise ValueError(f"a name expected at {i}")
        key, i = _scanstring(s, i + 1, True)
        i = _skip(s, i)
        if s[i] != ":":
            raise ValueError(f"':' expected at {i}")
        out[key], i = _value(s, _skip(s, i + 1))
        done, i = _after_item(s, i, "}")
        if done:
            return out, i


def _array(s: str, i: int) -> tuple:
    out: list = []
    if s[i] == "]":
        return out, i + 1
    while True:
        item, i = _value(s, i)
        out.append(item)
        done, i = _after_item(s, i, "]")
        if done:
            return out, i


def _after_item(s: str, i: int, close: str) -> tuple:
    """(True, past `close`) at the end of an object or array, else (False, at its next item)."""
    i = _skip(s, i)
    if s[i] == close:
        return True, i + 1
    if s[i] != ",":
        raise ValueError(f"',' expected at {i}")
    return False, _skip(s, i + 1)
