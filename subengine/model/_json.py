"""JSON for readers, at any depth: `loads` and `dumps` as the standard library's, which
fall back to a loop when a value is nested deeper than the caller's stack allows.

Python's `json` recurses once per level of nesting, so whether it can decode or encode a
value depends on how deep the caller already stands (an append refused data from about
995 levels in a short script, and a command-line read crashed on 990). Whatever the engine
stores, every reader must be able to read: the fast path is the standard library's, and
only a RecursionError takes the slower loop, which needs no stack.

`fast_loads` decodes with orjson where that gives exactly what `json.loads` gives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json.decoder import JSONDecodeError
from json.encoder import encode_basestring, encode_basestring_ascii
from json.scanner import NUMBER_RE
from typing import Any

import orjson

# the C scanner of a JSON string's rest (after its opening quote): its text and end
scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_LITERALS = {
    "null": None,
    "true": True,
    "false": False,
    "NaN": float("nan"),
    "Infinity": float("inf"),
    "-Infinity": float("-inf"),
}


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`, at any depth of nesting."""
    try:
        return json.loads(text)
    except RecursionError:
        return _loads_in_a_loop(text.decode() if isinstance(text, bytes) else text)


def dumps(
    value: Any, *, default: Callable[[Any], Any] | None = None, ensure_ascii: bool = True
) -> str:
    """`json.dumps(value, default=default, ensure_ascii=ensure_ascii)`, at any depth."""
    try:
        return json.dumps(value, default=default, ensure_ascii=ensure_ascii)
    except RecursionError:
        return _dumps_in_a_loop(value, default, ensure_ascii)


# A run of 19 digits: perhaps an integer beyond 64 bits, which orjson decodes as a float.
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * 19


def fast_loads(text: bytes) -> Any:
    """`json.loads(text)`'s value, decoded by orjson (about twice as fast on an append's
    body of small events); ValueError where orjson might decode otherwise or not at all,
    so decode those with `json.loads`, which may still take them: text orjson refuses
    (NaN, a lone surrogate, UTF-16, a byte order mark, nesting deeper than 1,024) and
    any run of 19 digits (integers beyond 64 bits become floats in orjson)."""
    if text.translate(_DIGITS_AS_ZEROS).find(_LONG_NUMBER) >= 0:
        raise ValueError("a long number: decode it with json.loads")
    return orjson.loads(text)


def _skip(text: str, position: int) -> int:
    end: int = _WHITESPACE.match(text, position).end()  # type: ignore[union-attr]
    return end


def _key(text: str, position: int) -> tuple[str, int]:
    """An object's key at `position`, and where its value starts."""
    if not text.startswith('"', position):
        raise JSONDecodeError("Expecting property name enclosed in double quotes", text, position)
    key, position = scanstring(text, position + 1)
    position = _skip(text, position)
    if not text.startswith(":", position):
        raise JSONDecodeError("Expecting ':' delimiter", text, position)
    return key, _skip(text, position + 1)


def _scalar(text: str, position: int) -> tuple[Any, int]:
    """The string, number or literal at `position`, and where it ends."""
    if text.startswith('"', position):
        return scanstring(text, position + 1)
    number = NUMBER_RE.match(text, position)
    if number is not None:
        integer, fraction, exponent = number.groups()
        if fraction or exponent:
            return float(integer + (fraction or "") + (exponent or "")), number.end()
        return int(integer), number.end()
    for literal, value in _LITERALS.items():
        if text.startswith(literal, position):
            return value, position + len(literal)
    raise JSONDecodeError("Expecting value", text, position)


def _loads_in_a_loop(text: str) -> Any:
    # the containers being filled, outermost first, each with the key its next value takes
    open_containers: list[tuple[list[Any] | dict[str, Any], str]] = []
    position = _skip(text, 0)
    while True:
        value: Any
        if text.startswith("[", position):
            position = _skip(text, position + 1)
            if not text.startswith("]", position):
                open_containers.append(([], ""))
                continue
            value, position = [], position + 1
        elif text.startswith("{", position):
            position = _skip(text, position + 1)
            if not text.startswith("}", position):
                key, position = _key(text, position)
                open_containers.append(({}, key))
                continue
            value, position = {}, position + 1
        else:
            value, position = _scalar(text, position)
        while True:
            position = _skip(text, position)
            if not open_containers:
                if position != len(text):
                    raise JSONDecodeError("Extra data", text, position)
                return value
            container, key = open_containers[-1]
            if isinstance(container, list):
                container.append(value)
            else:
                container[key] = value
            if text.startswith(",", position):
                position = _skip(text, position + 1)
                if isinstance(container, dict):
                    key, position = _key(text, position)
                    open_containers[-1] = (container, key)
                break
            if not text.startswith("]" if isinstance(container, list) else "}", position):
                raise JSONDecodeError("Expecting ',' delimiter", text, position)
            open_containers.pop()
            value, position = container, position + 1


def _key_text(key: Any) -> str:
    """A dict key as `json.dumps` writes it (before quoting)."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    if isinstance(key, int | float):
        return _scalar_text(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _scalar_text(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return int.__repr__(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


def _dumps_in_a_loop(value: Any, default: Callable[[Any], Any] | None, ensure_ascii: bool) -> str:
    quoted = encode_basestring_ascii if ensure_ascii else encode_basestring
    written: list[str] = []
    # what is left to write, last first: text as it is, or a value to encode
    left: list[tuple[bool, Any]] = [(False, value)]
    while left:
        is_text, item = left.pop()
        if is_text:
            written.append(item)
        elif isinstance(item, str):
            written.append(quoted(item))
        elif item is None or isinstance(item, bool | int | float):
            written.append(_scalar_text(item))
        elif isinstance(item, dict):
            parts: list[tuple[bool, Any]] = [(True, "{")]
            for index, (key, member) in enumerate(item.items()):
                separator = ", " if index else ""
                parts += [(True, f"{separator}{quoted(_key_text(key))}: "), (False, member)]
            left += reversed([*parts, (True, "}")])
        elif isinstance(item, list | tuple):
            parts = [(True, "[")]
            for index, member in enumerate(item):
                parts += [(True, ", " if index else ""), (False, member)]
            left += reversed([*parts, (True, "]")])
        elif default is not None:
            left.append((False, default(item)))
        else:
            raise TypeError(f"Object of type {type(item).__name__} is not JSON serializable")
    return "".join(written)
