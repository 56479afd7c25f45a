"""The Spark source's option failOnDataLoss and the gaps it finds below a partition's floor,
without Spark and without a database."""

from __future__ import annotations

import pytest

import subengine
from subengine import PartitionState, Tombstone

pytest.importorskip("pyspark", reason="PySpark is not installed: pip install -e '.[spark]'")

from subengine.spark import RetentionGap, _options, _store


def bounds(head: int, floor: int) -> PartitionState:
    return PartitionState("orders", 2, head, None, floor)


@pytest.mark.parametrize(("raw", "fail"), [(None, True), ("true", True), ("FALSE", False)])
def test_fail_on_data_loss_is_true_unless_set_to_false(raw: str | None, fail: bool) -> None:
    options = {"stream": "orders"} if raw is None else {"stream": "orders", "failOnDataLoss": raw}
    assert _options.read_options(options, "read").fail_on_data_loss is fail


@pytest.mark.parametrize("raw", ["yes", "0", "", " true"])
def test_fail_on_data_loss_is_true_or_false_and_nothing_else(raw: str) -> None:
    with pytest.raises(subengine.InvalidInput, match="option failOnDataLoss must be true or false"):
        _options.read_options({"stream": "orders", "failOnDataLoss": raw}, "read")


@pytest.mark.parametrize(
    ("after", "upto", "gap"),
    [
        (3, 10, Tombstone("orders", 2, 4, 6, 7)),
        (0, 5, Tombstone("orders", 2, 1, 5, 7)),  # the whole range is gone
        (5, 10, Tombstone("orders", 2, 6, 6, 7)),
    ],
)
def test_a_range_below_the_floor_fails_naming_exactly_its_missing_positions(
    after: int, upto: int, gap: Tombstone
) -> None:
    with pytest.raises(RetentionGap) as raised:
        _store.read_start("orders", bounds(10, 7), after, upto, fail_on_data_loss=True)
    assert raised.value.gap == gap
    assert "\n" not in str(raised.value)
    assert "set the option failOnDataLoss to false" in str(raised.value)


@pytest.mark.parametrize(("after", "upto", "start"), [(3, 10, 6), (0, 5, 5)])
def test_without_fail_on_data_loss_a_range_starts_after_its_missing_positions(
    after: int, upto: int, start: int
) -> None:
    assert _store.read_start("orders", bounds(10, 7), after, upto, False) == start


def test_a_range_from_the_floor_or_an_empty_one_loses_nothing() -> None:
    assert _store.read_start("orders", bounds(10, 7), 6, 10, True) == 6
    assert _store.read_start("orders", bounds(10, 7), 2, 2, True) == 2
