"""A real browser follows a stream through the gateway: headless Chromium's EventSource
receives every event, and when the server closes the stream (its lifetime ends) the
browser reconnects with Last-Event-ID and resumes exactly where it was."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import GatewayProcess, PageEventSource, wait_for
from playwright.sync_api import Page

import subengine

WAIT = 30.0


def test_a_browser_receives_events_and_resumes_after_the_server_closes_the_stream(
    page: Page, engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    engine.append(orders, [subengine.NewEvent(f"k{n}", "t", {"n": n}) for n in range(5)])
    with GatewayProcess(cli_env, "--stream-lifetime", "2", tmp=tmp_path) as gateway:
        source = PageEventSource(
            page,
            f"{gateway.url}/v1/streams/orders/events?live=sse&after=beginning",
            types=("events", "caught-up", "error"),
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
        # the "error" listener also hears the connection closing, which carries no data
        closes = [
            json.loads(m["data"])
            for m in source.messages()
            if m["type"] == "error" and m["data"] is not None
        ]
        assert closes and all(close["code"] == "rotate" for close in closes)
        source.close()
