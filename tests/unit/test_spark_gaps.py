"""The Spark source's option failOnDataLoss, without Spark and without a database."""

from __future__ import annotations

import pytest

import subengine

pytest.importorskip("pyspark", reason="PySpark is not installed: pip install -e '.[spark]'")

from subengine.spark import _options


@pytest.mark.parametrize(("raw", "fail"), [(None, True), ("true", True), ("FALSE", False)])
def test_fail_on_data_loss_is_true_unless_set_to_false(raw: str | None, fail: bool) -> None:
    options = {"stream": "orders"} if raw is None else {"stream": "orders", "failOnDataLoss": raw}
    assert _options.read_options(options, "read").fail_on_data_loss is fail


@pytest.mark.parametrize("raw", ["yes", "0", "", " true"])
def test_fail_on_data_loss_is_true_or_false_and_nothing_else(raw: str) -> None:
    with pytest.raises(subengine.InvalidInput, match="option failOnDataLoss must be true or false"):
        _options.read_options({"stream": "orders", "failOnDataLoss": raw}, "read")
