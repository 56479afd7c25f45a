"""A hundred SSE clients lose nothing when the gateway's LISTEN connection (and every other
connection of it) is terminated mid-stream: the hub resyncs and its head poll finds what
the lost notifications said, and every client gets every position exactly once. A gateway
whose database stops answering (refusing connections, or dropping them silently) still
exits soon after SIGTERM; while it answers, a webhook batch in flight at SIGTERM commits."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import web
from helpers import DELIVERING, Delivery, GatewayProcess, Proxy, Receiver, wait_for

import subengine

CLIENTS = 100
EVENTS = 60
# seconds a gateway whose database is gone may take to exit after SIGTERM: a bound for
# the test, well above the few it takes (it took 25 to 40, waiting for connections that
# could not come)
STOP_TIMEOUT = 15


async def follow(url: str, seen: list[int], ready: asyncio.Event, count: list[int]) -> None:
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(60.0), verify=web.TLS) as client,
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


def state(gateway: GatewayProcess, webhook_id: str) -> str | None:
    answer = web.get(f"{gateway.url}/v1/webhooks/{webhook_id}", timeout=30)
    return answer.json()["state"] if answer.status_code == 200 else None


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


@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_a_gateway_whose_database_went_away_stops_soon_after_sigterm(
    dsn: str, orders: str, cli_env: dict[str, str], tmp_path: Path, receiver: Receiver, outage: str
) -> None:
    proxy = Proxy(dsn).__enter__()
    env = {**cli_env, "SUBENGINE_DSN": proxy.dsn(dsn)}
    gateway = GatewayProcess(env, *DELIVERING, tmp=tmp_path)
    try:
        gateway.start()
        # a webhook being delivered: the delivery worker runs beside the supervisor
        body = {"callback": receiver.url, "streams": ["orders"]}
        answer = web.put(f"{gateway.url}/v1/webhooks/hook", json=body, timeout=30)
        assert answer.status_code == 202, answer.text
        wait_for(lambda: state(gateway, "hook") == "active", "the consent")
        if outage == "silent":  # a host that drops packets: connections hang
            proxy.silent = True
            proxy.cut()
        else:  # nothing listens any more: connections are refused
            proxy.__exit__()
        # the gateway found out: its listening connection broke
        wait_for(lambda: "listening connection failed" in gateway.output(), "the outage")
        assert gateway.process is not None
        gateway.process.send_signal(signal.SIGTERM)
        try:
            gateway.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the gateway did not exit within {STOP_TIMEOUT} s of SIGTERM"
            ) from None
    finally:
        if gateway.process is not None and gateway.process.poll() is None:
            gateway.kill()
        proxy.__exit__()


def test_a_batch_in_flight_at_sigterm_still_commits_while_the_database_answers(
    engine: subengine.Engine,
    orders: str,
    cli_env: dict[str, str],
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    gateway = GatewayProcess(cli_env, *DELIVERING, tmp=tmp_path).start()
    try:
        body = {"callback": receiver.url, "streams": ["orders"]}
        answer = web.put(f"{gateway.url}/v1/webhooks/hook", json=body, timeout=30)
        assert answer.status_code == 202, answer.text
        wait_for(lambda: state(gateway, "hook") == "active", "the consent")

        def slow_answer(delivery: Delivery) -> tuple[int, bytes, dict[str, str]]:
            time.sleep(3)  # the batch is in flight when its process is told to stop
            return 204, b"", {}

        receiver.answer = slow_answer
        engine.append(orders, [subengine.NewEvent("k", "T", {})])
        wait_for(lambda: receiver.of_type("events"), "a batch in flight")
        assert gateway.stop() == 0
    finally:
        if gateway.process is not None and gateway.process.poll() is None:
            gateway.kill()
    # its position committed and its success was recorded: nobody sends it again
    hook = engine.webhook("hook")
    assert (hook.lag, hook.delivered) == (0, 1)
