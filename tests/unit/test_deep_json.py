"""JSON for readers at any depth: the loop the stdlib's json falls back to writes and reads
what the stdlib would, and refuses what it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from subengine.model import _json

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@given(value=json_values, ensure_ascii=st.booleans())
def test_the_loop_writes_what_json_writes(value: Any, ensure_ascii: bool) -> None:
    expected = json.dumps(value, ensure_ascii=ensure_ascii)
    assert _json._dumps_in_a_loop(value, None, ensure_ascii) == expected


@given(value=json_values, indent=st.sampled_from([None, 1]))
def test_the_loop_reads_what_json_reads(value: Any, indent: int | None) -> None:
    text = json.dumps(value, indent=indent)
    assert json.dumps(_json._loads_in_a_loop(text)) == json.dumps(json.loads(text))


@pytest.mark.parametrize(
    "text", ["", "[1,]", "[1 2]", '{"a" 1}', '{"a": 1', "[1] 2", "tru", "{1: 2}"]
)
def test_the_loop_refuses_what_json_refuses(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        _json._loads_in_a_loop(text)


def test_values_deeper_than_the_stack_are_written_and_read() -> None:
    deep: Any = 1
    for level in range(50_000):
        deep = [deep] if level % 2 else {"a": deep}
    text = _json.dumps(deep)
    assert text.startswith('[{"a": [{"a": ') and len(text) == 25_000 * 9 + 1
    assert _json.dumps(_json.loads(text)) == text
    with pytest.raises(RecursionError):
        json.loads(text)
