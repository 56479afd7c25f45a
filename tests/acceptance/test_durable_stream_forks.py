"""Forks of Durable Streams streams beyond what the conformance suite checks
(docs/durable-streams.md, "Forks"): a fork copies none of its source's messages (a fork
point inside a byte message included), its engine stream numbers its own events on from
the fork point (and that is what the engine's readers see of it), offsets past the fork
point of its source are not its own, a source deleted softly goes with its last fork up
the chain, and retention keeps what a fork reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import web
from helpers import GatewayProcess, wait_for

import subengine
from subengine import Retention, Subscription

DS = ("--durable-streams", "--durable-streams-long-poll", "2")
TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


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


def fork(url: str, source: str, offset: str | None = None, **headers: str) -> httpx.Response:
    """PUT a fork of the stream at path `source` (below the prefix) at `url`."""
    asked = {"Stream-Forked-From": source, **headers}
    if offset is not None:
        asked["Stream-Fork-Offset"] = offset
    return web.put(url, headers=asked)


def test_a_fork_copies_nothing_and_numbers_its_own_events_on_from_the_fork_point(
    ds: GatewayProcess, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    source = f"{ds.url}/ds/draft"
    created = web.put(source, headers=TEXT, content=b"hello")
    assert created.status_code == 201
    after_hello = created.headers["Stream-Next-Offset"]
    assert web.post(source, headers=TEXT, content=b"world").status_code == 204

    # inherits "hello" and the first 3 bytes of "world"
    forked = fork(f"{ds.url}/ds/edit", "/draft", after_hello, **{"Stream-Fork-Sub-Offset": "3"})
    assert forked.status_code == 201
    assert web.post(f"{ds.url}/ds/edit", headers=TEXT, content=b"LD").status_code == 204
    assert web.get(f"{ds.url}/ds/edit").text == "helloworLD"
    assert web.get(source).text == "helloworld"

    own = engine_stream(sql, "/edit")
    stored = sql.execute(
        'SELECT "position", body FROM subengine.durable_stream_bytes WHERE stream = %s', (own,)
    ).fetchall()
    assert [(position, bytes(body)) for position, body in stored] == [(3, b"LD")]
    inherited = sql.execute(
        "SELECT source, after, upto, cut FROM subengine.durable_stream_inherited WHERE stream = %s",
        (own,),
    ).fetchall()
    assert inherited == [(engine_stream(sql, "/draft"), 0, 2, 3)]

    # the engine's readers see the fork's own event, at its place in the fork: 1 and 2
    # are its source's, below its engine stream's floor
    items = engine.read(own, 0)
    assert isinstance(items[0], subengine.Tombstone)
    assert (items[0].gap_from, items[0].gap_to) == (1, 2)
    assert [(e.position, e.data) for e in items[1:] if isinstance(e, subengine.Event)] == [
        (3, {"bytes": 2})
    ]
    handled: list[int] = []
    reader = Subscription(
        "reader", own, catch_all=lambda event, conn: handled.append(event.position)
    )
    engine.ensure_subscription(reader)
    engine.process_batch(reader, 0)
    assert handled == [3]


def test_a_fork_reads_its_sources_offsets_up_to_the_fork_point_only(ds: GatewayProcess) -> None:
    source = f"{ds.url}/ds/log"
    assert web.put(source, headers=JSON, content=b"[1, 2]").status_code == 201
    fork_point = web.head(source).headers["Stream-Next-Offset"]
    first = web.get(source, params={"offset": "-1"})
    assert fork(f"{ds.url}/ds/log-fork", "/log").status_code == 201
    assert web.post(source, headers=JSON, content=b"3").status_code == 204
    beyond = web.head(source).headers["Stream-Next-Offset"]
    assert web.post(f"{ds.url}/ds/log-fork", headers=JSON, content=b'"own"').status_code == 204

    url = f"{ds.url}/ds/log-fork"
    assert web.get(url).json() == [1, 2, "own"]
    assert web.head(url).headers["Stream-Next-Offset"] > beyond  # its own epoch
    at_fork_point = web.get(url, params={"offset": fork_point})
    assert at_fork_point.json() == ["own"]
    assert first.headers["Stream-Next-Offset"] == fork_point
    # the source's offset after its 3, which the fork never had
    refused = web.get(url, params={"offset": beyond})
    assert refused.status_code == 400
    bad = fork(f"{ds.url}/ds/other", "/log", beyond[:-1] + "9")
    assert bad.status_code == 400


def test_a_deleted_source_stays_for_its_forks_and_goes_with_the_last_of_them(
    ds: GatewayProcess, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    base = f"{ds.url}/ds"
    assert web.put(f"{base}/a", headers=TEXT, content=b"A").status_code == 201
    assert fork(f"{base}/b", "/a").status_code == 201
    assert web.post(f"{base}/b", headers=TEXT, content=b"B").status_code == 204
    assert fork(f"{base}/c", "/b").status_code == 201
    assert web.post(f"{base}/c", headers=TEXT, content=b"C").status_code == 204
    streams = {path: engine_stream(sql, path) for path in ("/a", "/b", "/c")}

    assert web.delete(f"{base}/a").status_code == 204
    assert web.delete(f"{base}/b").status_code == 204
    for path in ("/a", "/b"):
        for method in ("GET", "HEAD", "POST", "DELETE"):
            answer = web.request(method, f"{base}{path}", headers=TEXT, content=b"x")
            assert answer.status_code == 410, (method, path)
        assert web.put(f"{base}{path}", headers=TEXT).status_code == 409
        assert fork(f"{base}/d", path).status_code == 409
    assert web.get(f"{base}/c").text == "ABC"

    assert web.delete(f"{base}/c").status_code == 204
    for path in ("/a", "/b", "/c"):  # in the fork's own transaction, up the chain
        assert web.head(f"{base}{path}").status_code == 404
    wait_for(
        lambda: not set(streams.values()) & {s.name for s in engine.streams()},
        "the sweeper to delete the three engine streams",
        timeout=30,
    )


def test_retention_keeps_the_events_a_fork_reads(
    ds: GatewayProcess, engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    source = f"{ds.url}/ds/kept"
    assert web.put(source, headers=JSON, content=b"[1, 2, 3, 4]").status_code == 201
    assert fork(f"{ds.url}/ds/kept-fork", "/kept").status_code == 201
    assert web.post(source, headers=JSON, content=b"[5, 6]").status_code == 204
    stream = engine_stream(sql, "/kept")
    engine.set_retention(stream, Retention(max_events=1))

    assert engine.run_retention(stream).removed == 0
    assert web.get(f"{ds.url}/ds/kept-fork").json() == [1, 2, 3, 4]
    assert web.get(source).json() == [1, 2, 3, 4, 5, 6]

    assert web.delete(f"{ds.url}/ds/kept-fork").status_code == 204
    assert engine.run_retention(stream).removed == 5
    assert web.get(source).json() == [6]
