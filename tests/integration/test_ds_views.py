"""The Durable Streams views of engine streams, in process on a real PostgreSQL: a read
of a view looked up before its stream was deleted, or deleted and created again, never
serves another stream's events under the offsets of the one looked up."""

from __future__ import annotations

import asyncio

import pytest

import subengine
from subengine.gateway._ds_http import DsError
from subengine.gateway._ds_views import VIEWS, read_view, view_stream

PATH = f"{VIEWS}orders/0"


def test_a_view_read_serves_the_stream_it_looked_up(
    engine: subengine.Engine, async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    engine.create_stream("orders", partitions=1)
    engine.append("orders", [subengine.NewEvent("a", "T", {"n": n}) for n in range(3)])
    found = runner.run(view_stream(async_engine, PATH, "orders", 0))
    messages = runner.run(read_view(async_engine, found, 1, 1 << 20))
    assert [position for position, _ in messages] == [2, 3]


def test_a_view_read_after_its_stream_was_created_again_is_410_not_the_new_events(
    engine: subengine.Engine, async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    engine.create_stream("orders", partitions=1)
    engine.append("orders", [subengine.NewEvent("a", "T", {"n": n}) for n in range(3)])
    found = runner.run(view_stream(async_engine, PATH, "orders", 0))
    engine.delete_stream("orders")
    engine.create_stream("orders", partitions=1)
    engine.append("orders", [subengine.NewEvent("b", "T", {"n": n}) for n in range(3)])
    with pytest.raises(DsError) as raised:
        runner.run(read_view(async_engine, found, 1, 1 << 20))
    assert raised.value.status == 410


def test_a_view_read_after_its_stream_was_deleted_is_404(
    engine: subengine.Engine, async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    engine.create_stream("orders", partitions=1)
    found = runner.run(view_stream(async_engine, PATH, "orders", 0))
    engine.delete_stream("orders")
    with pytest.raises(DsError) as raised:
        runner.run(read_view(async_engine, found, 0, 1 << 20))
    assert raised.value.status == 404
