"""Parsing the JSON users type or pipe in (`--data`, `--metadata`, `--start`, JSON Lines).

Strict where Python's `json` is lenient (NaN, Infinity and numbers too large for a float
are not JSON), and every failure, however hostile the text, is a `ValueError` whose
message is one short line.
"""

from __future__ import annotations

import json
import math
from typing import Any

# What json.dumps() accepts back: past this many digits Python refuses to turn an int
# into text (sys.get_int_max_str_digits), so the append would refuse it anyway.
MAX_INTEGER_DIGITS = 4300
SHOWN_CHARACTERS = 60


def shown(text: str) -> str:
    """`text` quoted for an error message: repr(), cut short when it is long."""
    if len(text) <= SHOWN_CHARACTERS:
        return repr(text)
    return f"{text[:SHOWN_CHARACTERS]!r}... ({len(text)} characters)"


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise ValueError(f"a number has more than {MAX_INTEGER_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {shown(text)} is too large for a float")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse(text: str) -> Any:
    """The value of the JSON text `text`; raises ValueError saying why it is not JSON."""
    try:
        return json.loads(text, parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise ValueError("it is nested too deeply") from None
    except json.JSONDecodeError as error:
        # its message ends with a line, column and character offset; one of them suffices
        raise ValueError(f"{error.msg} at character {error.pos}") from None
