"""A hundred SSE clients lose nothing when the gateway's LISTEN connection (and every other
connection of it) is terminated mid-stream: the hub resyncs and its head poll finds what
the lost notifications said, and every client gets every position exactly once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import psycopg
from helpers import GatewayProcess

import subengine

CLIENTS = 100
EVENTS = 60


async def follow(url: str, seen: list[int], ready: asyncio.Event, count: list[int]) -> None:
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client,
        client.stream("GET", url, params={"live": "sse", "after": "beginning"}) as response,
    ):
        assert response.status_code == 200
        kind = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
                if kind == "caught-up":
                    count[0] += 1
                    if count[0] == CLIENTS:
                        ready.set()
            elif line.startswith("data: ") and kind == "events":
                seen.extend(e["data"]["n"] for e in json.loads(line[6:])["events"])
                if len(seen) >= EVENTS:
                    return


def terminate(sql: psycopg.Connection[Any], application_name: str) -> int:
    rows = sql.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = %s AND datname = current_database()",
        (application_name,),
    ).fetchall()
    return len(rows)


def test_a_hundred_clients_lose_nothing_when_the_listen_connection_dies(
    dsn: str, orders: str, gateway: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    url = f"{gateway.url}/v1/streams/orders/events"

    def append(numbers: range) -> None:
        # an engine of its own each time: the terminations below end every connection
        # named "subengine", this test's too
        with subengine.Engine(dsn) as engine:
            engine.append(orders, [subengine.NewEvent(f"k{n % 5}", "t", {"n": n}) for n in numbers])

    async def run() -> list[list[int]]:
        seen: list[list[int]] = [[] for _ in range(CLIENTS)]
        ready = asyncio.Event()
        count = [0]
        clients = [asyncio.create_task(follow(url, s, ready, count)) for s in seen]
        await asyncio.wait_for(ready.wait(), 60)
        for start in range(0, EVENTS // 2, 5):
            await asyncio.to_thread(append, range(start, start + 5))
        # the LISTEN connection and the pool's connections, mid-stream
        assert await asyncio.to_thread(terminate, sql, "subengine-tail") == 1
        await asyncio.to_thread(terminate, sql, "subengine")
        for start in range(EVENTS // 2, EVENTS, 5):
            await asyncio.to_thread(append, range(start, start + 5))
        await asyncio.wait_for(asyncio.gather(*clients), 90)
        return seen

    for seen in asyncio.run(run()):
        assert sorted(seen) == list(range(EVENTS))
