"""The tail's cursor, and the README's tail examples; what both tails do is in
test_tail_contract.py, run over `Tail` and `AsyncTail` alike."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import README

import subengine
from subengine import Cursor

# the cursor


def test_a_cursor_round_trips_through_its_text() -> None:
    for cursor in (Cursor("orders"), Cursor("a.b-c_1", (0, 17, 2**63 - 1))):
        assert Cursor.parse(str(cursor)) == cursor
    assert str(Cursor.at("orders", {1: 5, 0: 3})) == "orders:3,5"


@pytest.mark.parametrize(
    "text", ["orders", "orders:1,,2", "orders:-1", "orders:+1", "orders: 1", ":1", "o:1:2", ""]
)
def test_a_malformed_cursor_text_is_refused(text: str) -> None:
    with pytest.raises(subengine.InvalidInput):
        Cursor.parse(text)


# the README


def readme_block(heading: str) -> str:
    text = README.read_text()
    section = text.split(f"### {heading}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("heading", ["From asyncio", "A live tail"])
def test_the_readme_examples_run(heading: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", readme_block(heading)],
        env=cli_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]
    if heading == "A live tail":
        cursor = Cursor.parse(last)
        assert (cursor.stream, sum(cursor.positions)) == ("shipments", 3)
    else:
        assert sum(ast.literal_eval(last).values()) == 2
