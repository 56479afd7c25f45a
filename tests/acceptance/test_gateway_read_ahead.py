"""Pages read ahead for a pull (docs/gateway.md, "Reading events"): a page short of the
heads starts the read of the next one, which the request naming its cursor gets. That
page is the one the request would have read a moment earlier; one that reached the
heads is read again, so that a reader told it is up to date has seen every append made
before it asked."""

from __future__ import annotations

import time
from typing import Any

import httpx
import web
from helpers import GatewayProcess, scrape, value, wait_for

import subengine

TIMEOUT = httpx.Timeout(30.0)
METRIC = "subengine_gateway_pages_read_ahead_total"


def append(engine: subengine.Engine, stream: str, count: int, start: int = 0) -> None:
    engine.append(
        stream,
        [subengine.NewEvent(f"k{n % 7}", "created", {"n": n}) for n in range(start, start + count)],
    )


def outcomes(gateway: GatewayProcess) -> dict[str, float | None]:
    samples = scrape(gateway.port)
    return {outcome: value(samples, METRIC, outcome=outcome) for outcome in ("used", "at_end")}


def pull(url: str, cursor: str, limit: int, **params: Any) -> tuple[list[int], str, bool]:
    """One page: the numbers of its events, its cursor and whether it is up to date."""
    answer = web.get(url, params={"after": cursor, "limit": limit, **params}, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    page = answer.json()
    return [e["data"]["n"] for e in page["events"]], page["cursor"], page["up_to_date"]


def first_page(
    engine: subengine.Engine, stream: str, gateway: GatewayProcess, count: int
) -> tuple[str, list[int], str]:
    """`count` events appended to `stream`, and its first page of 10 read: the stream's
    URL, the page's numbers and its cursor."""
    append(engine, stream, count)
    url = f"{gateway.url}/v1/streams/{stream}/events"
    first, cursor, done = pull(url, "beginning", 10)
    assert (len(first), done) == (10, False)
    return url, first, cursor


def test_a_pull_gets_the_page_read_while_it_took_in_the_one_before(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    url, first, cursor = first_page(engine, orders, gateway, 30)
    second, cursor, done = pull(url, cursor, 10)  # read ahead
    assert (len(second), done) == (10, False)
    # the third page, read ahead, reached the heads: read again when asked for
    wait_for(lambda: outcomes(gateway)["at_end"] == 1, "the third page read ahead")
    third, cursor, done = pull(url, cursor, 10)
    assert (len(third), done) == (10, True)
    assert sorted(first + second + third) == list(range(30))
    assert outcomes(gateway) == {"used": 1, "at_end": 1}


def test_a_page_read_ahead_to_the_heads_is_read_again_and_sees_later_appends(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    url, first, cursor = first_page(engine, orders, gateway, 20)
    # the second page is read ahead, up to the heads of then; then five more come
    wait_for(lambda: outcomes(gateway)["at_end"] == 1, "the second page read ahead")
    append(engine, orders, 5, start=20)
    second, cursor, done = pull(url, cursor, 10)
    assert (len(second), done) == (10, False)  # not "up to date" without the five
    third, _, done = pull(url, cursor, 10)
    assert (len(third), done) == (5, True)
    assert sorted(first + second + third) == list(range(25))
    assert outcomes(gateway)["used"] == 0


def test_a_page_read_ahead_is_only_for_a_request_of_the_same_selection(
    engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    engine.create_stream("single", partitions=1)
    append(engine, "single", 50)  # in order: event n at position n + 1, key k(n % 7)
    url = f"{gateway.url}/v1/streams/single/events"
    # a limit counts the events read, kept or passed over
    first, cursor, done = pull(url, "beginning", 10, key="k1")
    assert (first, done) == ([1, 8], False)  # and k1's of the next ten are read ahead
    assert pull(url, cursor, 10)[0] == list(range(10, 20))  # every key: not that page
    assert pull(url, cursor, 10, key="k1", include_data="true")[0] == [15]
    assert outcomes(gateway)["used"] == 1


def test_a_page_read_ahead_of_a_stream_deleted_since_is_not_served(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    url, _, cursor = first_page(engine, orders, gateway, 30)
    time.sleep(0.5)  # the second page is read meanwhile (in a few milliseconds)
    engine.delete_stream(orders)
    engine.create_stream(orders, 2)
    engine.append(orders, [subengine.NewEvent("b", "created", {"n": 100})])
    answer = web.get(url, params={"after": cursor, "limit": 10}, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    page = answer.json()
    assert [r["stream"] for r in page["resets"]] == [orders]
    assert [e["data"]["n"] for e in page["events"]] == [100]
    # deleted and not created again: not found, though a page was read ahead before
    append(engine, orders, 2, start=101)
    _, cursor, done = pull(url, "beginning", 1)
    assert not done
    time.sleep(0.5)
    engine.delete_stream(orders)
    assert web.get(url, params={"after": cursor, "limit": 1}, timeout=TIMEOUT).status_code == 404
