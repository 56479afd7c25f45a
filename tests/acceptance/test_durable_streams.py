"""The gateway's Durable Streams surface beyond what the protocol's conformance suite
checks (docs/durable-streams.md): its streams are engine streams whose events workers
handle once, bytes are kept byte for byte, producer state outlives the process, engine
streams are readable per partition and read only, deleted incarnations and removed
ranges are 410, expired streams are swept, and API keys are bearer tokens."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import web
from helpers import GatewayProcess, Running, record, run_subengine, scrape, value, wait_for

import subengine
from subengine import NewEvent, Retention

DS = ("--durable-streams", "--durable-streams-long-poll", "2")


@pytest.fixture
def ds(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """`subengine serve --durable-streams` on the test database."""
    with GatewayProcess(cli_env, *DS, tmp=tmp_path) as process:
        yield process


def engine_stream(sql: psycopg.Connection[Any], path: str) -> str:
    row = sql.execute("SELECT stream FROM subengine.durable_streams WHERE path = %s", (path,))
    found = row.fetchone()
    assert found is not None, f"no catalog row for {path}"
    return str(found[0])


def test_messages_appended_through_ds_are_engine_events_a_worker_handles_once(
    ds: GatewayProcess, fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    url = f"{ds.url}/ds/orders/created"
    json_type = {"Content-Type": "application/json"}
    assert web.put(url, headers=json_type, content=b'[{"n": 1}]').status_code == 201
    assert web.post(url, headers=json_type, content=b'[{"n": 2}, {"n": 3}]').status_code == 204
    closed = web.post(url, headers={"Stream-Closed": "true"})
    assert closed.status_code == 204
    stream = engine_stream(sql, "/orders/created")
    assert stream.startswith("ds.orders-created.")

    events = [e for e in fast_engine.read(stream, 0) if isinstance(e, subengine.Event)]
    assert [(e.type, e.data) for e in events] == [
        ("durable-streams.message", {"n": 1}),
        ("durable-streams.message", {"n": 2}),
        ("durable-streams.message", {"n": 3}),
        ("durable-streams.closed", {}),
    ]
    native = web.get(f"{ds.url}/v1/streams/{stream}/events").json()
    assert [e["data"] for e in native["events"]] == [{"n": 1}, {"n": 2}, {"n": 3}, {}]
    app = subengine.App()
    app.subscription("billing", stream=stream).handler()(record)
    with Running(app, fast_engine):
        wait_for(lambda: _count(sql) == 4, "the worker to handle the four events")
        more = web.post(url, headers=json_type, content=b'{"n": 4}')
        assert more.status_code == 409  # closed: nothing more to handle
    handled = sql.execute("SELECT count(DISTINCT event_id), count(*) FROM effects").fetchone()
    assert handled == (4, 4)


def test_json_messages_are_stored_as_the_body_holds_them_on_either_append_path(
    ds: GatewayProcess, fast_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # The first append goes to PostgreSQL as one JSON array (the gateway's fast path);
    # the second holds an integer beyond 64 bits, which only json.loads decodes exactly,
    # so it takes the general path. Both store what the body says.
    url = f"{ds.url}/ds/prices"
    json_type = {"Content-Type": "application/json"}
    assert web.put(url, headers=json_type).status_code == 201
    bodies = [
        b'[{"price": 1e-05, "name": "caf\\u00e9", "tags": [1, [2, {"x": null}]]}, "text", null]',
        b'[{"n": 123456789012345678901234567890}, 0.1, {"deep": {"er": [true, false]}}]',
    ]
    for body in bodies:
        assert web.post(url, headers=json_type, content=body).status_code == 204
    stream = engine_stream(sql, "/prices")

    events = [e for e in fast_engine.read(stream, 0) if isinstance(e, subengine.Event)]
    expected = [message for body in bodies for message in json.loads(body)]
    assert [e.data for e in events] == expected
    assert {e.type for e in events} == {"durable-streams.message"}
    assert [e.position for e in events] == list(range(1, len(expected) + 1))
    stored = sql.execute(
        "SELECT data::text FROM subengine.events WHERE stream = %s ORDER BY position", (stream,)
    )
    assert [row[0] for row in stored][3] == '{"n": 123456789012345678901234567890}'


def _count(sql: psycopg.Connection[Any]) -> int:
    row = sql.execute("SELECT count(*) FROM effects").fetchone()
    return int(row[0]) if row else 0


def test_byte_messages_are_stored_byte_for_byte_beside_their_events(
    ds: GatewayProcess, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    url = f"{ds.url}/ds/blobs/1"
    octets = {"Content-Type": "application/octet-stream"}
    first, second = bytes(range(256)), b"\x00\xff\xfe not UTF-8 \xc3\x28"
    assert web.put(url, headers=octets, content=first).status_code == 201
    assert web.post(url, headers=octets, content=second).status_code == 204

    read = web.get(url)
    assert read.content == first + second
    assert read.headers["Stream-Up-To-Date"] == "true"
    stream = engine_stream(sql, "/blobs/1")
    stored = sql.execute(
        'SELECT body FROM subengine.durable_stream_bytes WHERE stream = %s ORDER BY "position"',
        (stream,),
    ).fetchall()
    assert [bytes(row[0]) for row in stored] == [first, second]
    events = [e for e in engine.read(stream, 0) if isinstance(e, subengine.Event)]
    assert [e.data for e in events] == [{"bytes": 256}, {"bytes": len(second)}]


def test_producer_state_survives_a_restart_of_the_gateway(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    def producer(seq: int, epoch: int = 0) -> dict[str, str]:
        return {
            "Content-Type": "text/plain",
            "Producer-Id": "writer-1",
            "Producer-Epoch": str(epoch),
            "Producer-Seq": str(seq),
        }

    with GatewayProcess(cli_env, *DS, tmp=tmp_path) as first:
        url = f"{first.url}/ds/log"
        assert web.put(url, headers={"Content-Type": "text/plain"}).status_code == 201
        assert web.post(url, headers=producer(0), content=b"a").status_code == 200
        assert web.post(url, headers=producer(1), content=b"b").status_code == 200
    with GatewayProcess(cli_env, *DS, tmp=tmp_path) as second:
        url = f"{second.url}/ds/log"
        retry = web.post(url, headers=producer(1), content=b"b")
        assert (retry.status_code, retry.headers["Producer-Seq"]) == (204, "1")
        gap = web.post(url, headers=producer(3), content=b"d")
        assert (gap.status_code, gap.headers["Producer-Expected-Seq"]) == (409, "2")
        assert web.post(url, headers=producer(2), content=b"c").status_code == 200
        zombie = web.post(url, headers=producer(0, epoch=1), content=b"x")
        assert zombie.status_code == 200  # a new epoch fences the old one
        stale = web.post(url, headers=producer(3), content=b"y")
        assert (stale.status_code, stale.headers["Producer-Epoch"]) == (403, "1")
        assert web.get(url).text == "abcx"


def test_an_engine_stream_is_read_per_partition_and_read_only(
    ds: GatewayProcess, engine: subengine.Engine
) -> None:
    engine.create_stream("orders", partitions=4)
    engine.append("orders", [NewEvent("order-1", "OrderPlaced", {"total": n}) for n in (1, 2)])
    partition = subengine.partition_for("order-1", 4)
    url = f"{ds.url}/ds/__subengine/streams/orders/{partition}"

    page = web.get(url)
    assert page.status_code == 200
    assert page.headers["Content-Type"] == "application/json"
    events = page.json()
    assert [(e["type"], e["data"], e["position"]) for e in events] == [
        ("OrderPlaced", {"total": 1}, 1),
        ("OrderPlaced", {"total": 2}, 2),
    ]
    tail = page.headers["Stream-Next-Offset"]
    assert web.get(url, params={"offset": tail}).content == b"[]"
    with httpx.Client(timeout=30, verify=web.TLS) as client:
        engine.append("orders", [NewEvent("order-1", "OrderPaid", {"total": 2})])
        poll = client.get(url, params={"offset": tail, "live": "long-poll"})
    assert [e["type"] for e in poll.json()] == ["OrderPaid"]
    assert poll.headers["Stream-Next-Offset"] > tail

    for method in ("POST", "PUT", "DELETE"):
        refused = web.request(method, url, headers={"Content-Type": "application/json"})
        assert refused.status_code == 405, method
        assert refused.headers["Allow"] == "GET, HEAD, OPTIONS"
    assert web.get(f"{ds.url}/ds/__subengine/streams/orders/4").status_code == 404


def test_below_the_retention_floor_is_gone_with_the_missing_range(
    ds: GatewayProcess, engine: subengine.Engine
) -> None:
    engine.create_stream("events", partitions=1, retention=Retention(max_events=2))
    engine.append("events", [NewEvent("k", "T", {"n": n}) for n in range(5)])
    url = f"{ds.url}/ds/__subengine/streams/events/0"
    tail = web.get(url).headers["Stream-Next-Offset"]
    after_first = tail[: -len("5")] + "1"  # the offset after position 1 of 5
    engine.run_retention("events")  # keeps positions 4 and 5

    gone = web.get(url, params={"offset": after_first})
    assert gone.status_code == 410
    assert (gone.headers["Subengine-Gap-From"], gone.headers["Subengine-Gap-To"]) == ("2", "3")
    resume = web.get(url, params={"offset": gone.headers["Subengine-Floor"]})
    assert [e["data"] for e in resume.json()] == [{"n": 3}, {"n": 4}]
    assert [e["data"] for e in web.get(url).json()] == [{"n": 3}, {"n": 4}]


def test_an_offset_of_a_deleted_incarnation_is_gone(ds: GatewayProcess) -> None:
    url = f"{ds.url}/ds/again"
    text = {"Content-Type": "text/plain"}
    assert web.put(url, headers=text, content=b"old").status_code == 201
    old = web.get(url).headers["Stream-Next-Offset"]
    assert web.delete(url).status_code == 204
    created = web.put(url, headers=text, content=b"new")
    assert created.status_code == 201
    assert created.headers["Stream-Next-Offset"] > old  # offsets keep increasing

    assert web.get(url, params={"offset": old}).status_code == 410
    assert web.get(url).text == "new"


def test_an_expired_stream_is_swept_with_its_engine_stream(
    ds: GatewayProcess, sql: psycopg.Connection[Any]
) -> None:
    url = f"{ds.url}/ds/short-lived"
    put = web.put(url, headers={"Content-Type": "text/plain", "Stream-TTL": "1"}, content=b"x")
    assert put.status_code == 201
    stream = engine_stream(sql, "/short-lived")

    def swept() -> bool:
        left = sql.execute(
            "SELECT (SELECT count(*) FROM subengine.durable_streams)"
            " + (SELECT count(*) FROM subengine.streams WHERE name = %(s)s)"
            " + (SELECT count(*) FROM subengine.durable_stream_bytes WHERE stream = %(s)s)"
            " + (SELECT count(*) FROM subengine.durable_stream_garbage)",
            {"s": stream},
        ).fetchone()
        return left == (0,)

    wait_for(swept, "the sweeper to remove the expired stream", timeout=30)
    assert web.get(url).status_code == 404


def test_api_keys_are_bearer_tokens_on_the_engine_stream_names(
    ds: GatewayProcess, engine: subengine.Engine
) -> None:
    _, token = engine.create_api_key(["read", "append"], ["ds.orders*"])
    _, other = engine.create_api_key(["read", "append"], ["payments*"])
    url = f"{ds.url}/ds/orders/1"

    refused = web.put(url, headers={"Content-Type": "text/plain"})
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"] == "Bearer"
    forbidden = web.put(url, headers={"Authorization": f"Bearer {other}"})
    assert forbidden.status_code == 403
    allowed = {"Authorization": f"Bearer {token}", "Content-Type": "text/plain"}
    assert web.put(url, headers=allowed, content=b"hi").status_code == 201
    assert web.get(url, headers=allowed).text == "hi"
    assert "secret" not in refused.text and token not in ds.output()


def test_a_stream_a_subscription_consumes_is_not_deleted_under_it(
    ds: GatewayProcess, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    url = f"{ds.url}/ds/consumed"
    put = web.put(url, headers={"Content-Type": "text/plain", "Stream-TTL": "1"}, content=b"x")
    assert put.status_code == 201
    stream = engine_stream(sql, "/consumed")
    app = subengine.App()
    app.subscription("reader", stream=stream).handler()(record)
    engine.ensure_subscription(app.subscriptions["reader"])

    refused = web.delete(url)
    assert refused.status_code == 409
    # expired: the path is free, but the engine stream stays while it is consumed
    # HEAD, unlike GET, does not reset the TTL's countdown
    wait_for(lambda: web.head(url).status_code == 404, "the stream to expire", timeout=30)
    wait_for(
        lambda: _garbage(sql) == [stream], "the sweeper to leave it to the subscription", timeout=30
    )
    assert [s.name for s in engine.streams()] == [stream]
    engine.delete_subscription("reader")
    # the sweeper deletes the engine stream, then forgets it: wait for both
    wait_for(
        lambda: not engine.streams() and not _garbage(sql),
        "the sweeper to delete it then",
        timeout=30,
    )


def _garbage(sql: psycopg.Connection[Any]) -> list[str]:
    rows = sql.execute("SELECT stream FROM subengine.durable_stream_garbage").fetchall()
    return [row[0] for row in rows]


def test_the_engine_stream_of_a_durable_stream_is_not_deleted_from_under_it(
    ds: GatewayProcess, cli_env: dict[str, str], sql: psycopg.Connection[Any]
) -> None:
    url = f"{ds.url}/ds/kept"
    assert web.put(url, headers={"Content-Type": "text/plain"}, content=b"x").status_code == 201
    fork = {"Content-Type": "text/plain", "Stream-Forked-From": "/kept"}
    assert web.put(f"{ds.url}/ds/kept-fork", headers=fork).status_code == 201
    stream = engine_stream(sql, "/kept")
    refused = run_subengine(cli_env, "stream", "delete", stream, "--force")
    assert refused.returncode == 1
    assert "holds the Durable Streams stream '/kept'" in refused.stderr, refused.stderr
    assert web.get(f"{url}?offset=-1").text == "x"
    # deleted, the source stays while its fork reads it: still refused
    assert web.delete(url).status_code == 204
    again = run_subengine(cli_env, "stream", "delete", stream, "--force")
    assert "holds the Durable Streams stream '/kept'" in again.stderr, again.stderr
    assert web.get(f"{ds.url}/ds/kept-fork?offset=-1").text == "x"


def test_retention_of_a_byte_stream_takes_its_bytes_too(
    ds: GatewayProcess, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    url = f"{ds.url}/ds/blobs/kept-short"
    octets = {"Content-Type": "application/octet-stream"}
    assert web.put(url, headers=octets, content=b"one").status_code == 201
    for body in (b"two", b"three"):
        assert web.post(url, headers=octets, content=body).status_code == 204
    stream = engine_stream(sql, "/blobs/kept-short")
    engine.set_retention(stream, Retention(max_events=1))
    engine.run_retention(stream)

    def stored() -> list[bytes]:
        rows = sql.execute(
            'SELECT body FROM subengine.durable_stream_bytes WHERE stream = %s ORDER BY "position"',
            (stream,),
        ).fetchall()
        return [bytes(row[0]) for row in rows]

    wait_for(lambda: stored() == [b"three"], "the sweeper to drop the pruned bytes", timeout=30)
    assert web.get(url).content == b"three"  # a read from the start begins at the floor


def test_a_long_poll_that_retention_passes_while_it_waits_is_gone_not_short(
    ds: GatewayProcess,
    engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    url = f"{ds.url}/ds/passed"
    json_type = {"Content-Type": "application/json"}
    created = web.put(url, headers=json_type, content=b'[{"n": 1}]')
    assert created.status_code == 201
    waiting_at = created.headers["Stream-Next-Offset"]
    stream = engine_stream(sql, "/passed")
    engine.set_retention(stream, Retention(max_events=1))
    with GatewayProcess(cli_env, *DS, tmp=tmp_path) as other, ThreadPoolExecutor(1) as pool:
        poll = pool.submit(
            httpx.get, url, params={"offset": waiting_at, "live": "long-poll"}, timeout=30
        )
        wait_for(lambda: _waiting_readers(ds) == 1, "the long-poll to wait")
        # the gateway sleeps while messages 2 to 4 come through another and retention keeps
        # the last: woken, the long-poll must not answer with 4 as if 2 and 3 had not been
        assert ds.process is not None
        os.kill(ds.process.pid, signal.SIGSTOP)
        try:
            posted = web.post(
                f"{other.url}/ds/passed",
                headers=json_type,
                content=b'[{"n": 2}, {"n": 3}, {"n": 4}]',
            )
            assert posted.status_code == 204
            engine.run_retention(stream)
        finally:
            os.kill(ds.process.pid, signal.SIGCONT)
        answer = poll.result()
    assert answer.status_code == 410, answer.text
    assert (answer.headers["Subengine-Gap-From"], answer.headers["Subengine-Gap-To"]) == ("2", "3")
    resume = web.get(url, params={"offset": answer.headers["Subengine-Floor"]})
    assert resume.json() == [{"n": 4}]


def _waiting_readers(ds: GatewayProcess) -> int:
    metrics = web.get(f"{ds.url}/metrics").text
    for line in metrics.splitlines():
        if line.startswith("subengine_gateway_connections{") and 'kind="long_poll"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_a_catch_up_page_holds_5000_small_messages_or_about_1_mib(ds: GatewayProcess) -> None:
    json_type = {"Content-Type": "application/json"}
    small, big = f"{ds.url}/ds/pages/small", f"{ds.url}/ds/pages/big"
    assert web.put(small, headers=json_type).status_code == 201
    assert web.put(big, headers=json_type).status_code == 201
    for first in range(0, 12_000, 3_000):
        body = "[" + ",".join(f'{{"n":{n}}}' for n in range(first, first + 3_000)) + "]"
        assert web.post(small, headers=json_type, content=body).status_code == 204
    for first in range(0, 300, 100):  # 5 KB a message that does not compress: 1.5 MB
        pads = [os.urandom(2_500).hex() for _ in range(100)]
        body = "[" + ",".join(f'{{"n":{first + n},"pad":"{pad}"}}' for n, pad in enumerate(pads))
        assert web.post(big, headers=json_type, content=body + "]").status_code == 204

    def pages(url: str) -> list[int]:
        sizes, offset = [], "-1"
        while True:
            read = web.get(url, params={"offset": offset}, timeout=30)
            read.raise_for_status()
            sizes.append(len(read.json()))
            offset = read.headers["Stream-Next-Offset"]
            if read.headers.get("Stream-Up-To-Date") == "true":
                return sizes

    assert pages(small) == [5_000, 5_000, 2_000]
    big_pages = pages(big)
    assert sum(big_pages) == 300 and len(big_pages) > 1, big_pages


def test_the_next_catch_up_page_is_read_while_the_reader_takes_in_this_one(
    ds: GatewayProcess,
) -> None:
    json_type = {"Content-Type": "application/json"}
    url = f"{ds.url}/ds/pages/ahead"
    assert web.put(url, headers=json_type).status_code == 201

    def append(first: int, count: int) -> None:
        body = "[" + ",".join(f'{{"n":{n}}}' for n in range(first, first + count)) + "]"
        assert web.post(url, headers=json_type, content=body).status_code == 204

    def page(offset: str) -> tuple[list[int], str, bool]:
        read = web.get(url, params={"offset": offset}, timeout=30)
        read.raise_for_status()
        up_to_date = read.headers.get("Stream-Up-To-Date") == "true"
        return [m["n"] for m in read.json()], read.headers["Stream-Next-Offset"], up_to_date

    def read_ahead(outcome: str) -> float | None:
        return value(scrape(ds.port), "subengine_gateway_pages_read_ahead_total", outcome=outcome)

    append(0, 6_000)
    append(6_000, 6_000)
    first, offset, done = page("-1")
    assert (len(first), done) == (5_000, False)
    append(12_000, 10)  # after the second page was read ahead: the third has them
    second, offset, done = page(offset)
    assert (len(second), done) == (5_000, False)
    third, offset, done = page(offset)
    assert (len(third), done) == (2_010, True)
    assert first + second + third == list(range(12_010))
    assert read_ahead("used") == 2
    assert read_ahead("unused") == 0


def test_a_page_read_ahead_serves_no_other_stream_at_its_path_and_is_dropped_unasked(
    ds: GatewayProcess,
) -> None:
    json_type = {"Content-Type": "application/json"}
    url = f"{ds.url}/ds/pages/again"

    def create(label: str) -> None:
        assert web.put(url, headers=json_type).status_code == 201
        for first in range(0, 6_000, 3_000):
            body = ",".join(f'{{"n":{n},"of":"{label}"}}' for n in range(first, first + 3_000))
            assert web.post(url, headers=json_type, content=f"[{body}]").status_code == 204

    def read_ahead(outcome: str) -> float | None:
        return value(scrape(ds.port), "subengine_gateway_pages_read_ahead_total", outcome=outcome)

    create("old")
    first = web.get(url, params={"offset": "-1"}, timeout=30)
    assert len(first.json()) == 5_000  # and the rest is read ahead
    assert web.delete(url).status_code == 204
    create("new")
    stale = web.get(url, params={"offset": first.headers["Stream-Next-Offset"]}, timeout=30)
    assert stale.status_code == 410, stale.text
    fresh = web.get(url, params={"offset": "-1"}, timeout=30)
    assert {m["of"] for m in fresh.json()} == {"new"}
    assert read_ahead("used") == 0
    # the old stream's page and the new one's (read ahead after `fresh`) go unasked
    wait_for(lambda: read_ahead("unused") == 2, "the unasked pages dropped", timeout=30)
