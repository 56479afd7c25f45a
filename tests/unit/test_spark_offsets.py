"""Spark offsets and admission control, without Spark and without a database."""

from __future__ import annotations

import pytest

import subengine

pytest.importorskip("pyspark", reason="PySpark is not installed: pip install -e '.[spark]'")

from subengine.spark import _offsets


def test_offsets_have_one_canonical_json_form() -> None:
    assert _offsets.offset_json({10: 4, 2: 7, 0: 1}) == '{"0":1,"10":4,"2":7}'
    assert list(_offsets.to_offset({10: 4, 2: 7, 0: 1})) == ["0", "10", "2"]
    with pytest.raises(subengine.InvalidInput, match="does not fit this query"):
        _offsets.from_offset({"0": 1, "1": 2}, (0, 1, 2))


def test_admission_shares_the_limit_by_what_each_partition_has_waiting() -> None:
    start = {0: 0, 1: 10, 2: 5}
    heads = {0: 90, 1: 20, 2: 5}
    admitted = _offsets.admit(start, heads, 10)
    assert sum(admitted[p] - start[p] for p in start) == 10
    assert admitted == {0: 9, 1: 11, 2: 5}
    assert _offsets.admit(start, heads, 1000) == heads
    assert sum(_offsets.admit({0: 0, 1: 0, 2: 0}, {0: 1, 1: 1, 2: 1}, 1).values()) == 1
