"""A real browser follows a stream through the gateway: headless Chromium's EventSource
receives every event, and when the server closes the stream (its lifetime ends) the
browser reconnects with Last-Event-ID and resumes exactly where it was."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import GatewayProcess, PageEventSource, open_blank_page_of, wait_for
from playwright.sync_api import Page

import subengine

WAIT = 30.0
# EventSource.CLOSED: it gave up and will not reconnect
CLOSED = 2


def test_a_browser_receives_events_and_resumes_after_the_server_closes_the_stream(
    page: Page, engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n}) for n in range(5)])
    with GatewayProcess(cli_env, "--stream-lifetime", "2", tmp=tmp_path) as gateway:
        source = PageEventSource(
            page,
            f"{gateway.url}/v1/streams/orders/events?live=sse&after=beginning",
            types=("events", "caught-up", "close", "error"),
        )

        def numbers() -> list[int]:
            return [
                event["data"]["n"]
                for message in source.messages()
                if message["type"] == "events"
                for event in json.loads(message["data"])["events"]
            ]

        wait_for(lambda: len(numbers()) == 5, "the first events in the browser", WAIT)
        # the server closes the stream after about 2 s; the browser comes back by itself
        wait_for(lambda: source.counts()[0] >= 2, "the browser to reconnect", WAIT)
        engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n}) for n in range(5, 9)])
        wait_for(lambda: len(numbers()) >= 9, "the later events in the browser", WAIT)
        assert sorted(numbers()) == list(range(9))
        closes = [json.loads(m["data"]) for m in source.messages() if m["type"] == "close"]
        assert closes and all(close["code"] == "rotate" for close in closes)
        # EventSource's own "error" is the connection ending: no frame lands there
        assert all(m["data"] is None for m in source.messages() if m["type"] == "error")
        source.close()


def _docs_event_source_example() -> str:
    """The JavaScript example of docs/gateway.md's "Server-sent events"."""
    text = (Path(__file__).parents[2] / "docs" / "gateway.md").read_text()
    example = text.split("```js\n", 1)[1].split("```", 1)[0]
    assert 'addEventListener("close"' in example and "onerror" in example
    return example


# What the docs' example calls, recorded in window.app; and its EventSource kept there.
_RUN_THE_DOCS_EXAMPLE = """([example, url]) => {
    const app = window.app = {numbers: [], gaps: 0, offline: 0, closes: 0};
    const render = (events) => app.numbers.push(...events.map((e) => e.data.n));
    const markIncomplete = () => { app.gaps += 1; };
    const showOffline = () => { app.offline += 1; };
    eval(example.replace('"/v1/streams/orders/events?live=sse&after=now"', "url")
        + "; app.source = source;");
    app.source.addEventListener("close", () => { app.closes += 1; });
}"""


def test_the_docs_browser_example_reads_on_across_rotations(
    page: Page, engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n}) for n in range(5)])
    with GatewayProcess(cli_env, "--stream-lifetime", "1", tmp=tmp_path) as gateway:
        url = f"{gateway.url}/v1/streams/orders/events?live=sse&after=beginning"
        open_blank_page_of(page, url)
        page.evaluate(_RUN_THE_DOCS_EXAMPLE, [_docs_event_source_example(), url])

        def numbers() -> list[int]:
            shown: list[int] = page.evaluate("window.app.numbers")
            return shown

        wait_for(lambda: len(numbers()) == 5, "the first events in the browser", WAIT)
        wait_for(lambda: page.evaluate("window.app.closes") >= 2, "two rotations", WAIT)
        engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n}) for n in range(5, 9)])
        wait_for(lambda: len(numbers()) >= 9, "the later events in the browser", WAIT)
        assert sorted(numbers()) == list(range(9))
        # it never gave up: each rotation was followed by a reconnection
        assert page.evaluate("[window.app.offline, window.app.source.readyState]")[0] == 0
        assert page.evaluate("window.app.source.readyState") != CLOSED
        page.evaluate("window.app.source.close()")
