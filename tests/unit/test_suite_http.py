"""The suite's one-off HTTP requests go through `web` (tests/web.py), which shares one TLS
context: httpx's one-request functions build one per request (17 ms of CPU each)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent.parent
ONE_OFF = re.compile(r"\bhttpx\.(get|head|options|post|put|patch|delete|request|stream)\(")


def test_no_test_calls_an_httpx_one_request_function() -> None:
    calls = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in ("web.py", Path(__file__).name)
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if ONE_OFF.search(line)
    ]
    assert not calls, "call web.get(...) and its siblings instead: " + ", ".join(calls)


def test_the_check_finds_a_call() -> None:
    assert ONE_OFF.search("    response = httpx.get(url, timeout=5)")
    assert not ONE_OFF.search("    response = web.get(url, timeout=5)")
