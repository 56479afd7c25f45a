"""Both official Durable Streams clients against a real `subengine serve --durable-streams`
(docs/durable-streams.md): the TypeScript one (`@durable-streams/client`, run by
tests/conformance/interop.mjs; skipped without node and npm) and the Python one
(`durable-streams` from PyPI). They create streams, append (the TypeScript one through
its idempotent producer, and closes), subscribe by SSE and long-poll, resume from a
saved offset, and carry on across a restart of the gateway; the TypeScript one forks a
stream (its create() with the fork headers: it has no call of its own for it) and reads
the fork."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import web
from ds_suite import suite_folder
from durable_streams import DurableStream
from helpers import GatewayProcess, free_port, serving, wait_for

from subengine.gateway import GatewayConfig, close_all_streams, create_app

DS = ("--durable-streams", "--durable-streams-long-poll", "2")
CLIENT_SECONDS = 60

pytestmark = pytest.mark.xdist_group("durable-streams-conformance")


def node(folder: Path, *args: str) -> dict[str, Any]:
    """Run the TypeScript client's script; the last line it printed, as JSON."""
    done = subprocess.run(
        ["node", "interop.mjs", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=CLIENT_SECONDS,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return last


def follow(folder: Path, url: str, offset: str, count: str, mode: str) -> subprocess.Popen[str]:
    """The TypeScript client following `url` from `offset` until it has `count` messages
    or the stream closes (`mode`: sse or long-poll), as a process; it prints what it read."""
    return subprocess.Popen(
        ["node", "interop.mjs", "follow", url, offset, count, mode],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def what_it_read(follower: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    """What `follow`'s process read (its last line) and its stderr, once it exits; killed
    if it does not within CLIENT_SECONDS, and a failure if it exits other than 0."""
    try:
        out, err = follower.communicate(timeout=CLIENT_SECONDS)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err[-3000:]
    last: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return last, err


def test_the_typescript_client_produces_follows_and_survives_a_restart(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    folder = suite_folder()
    port = free_port()
    first = GatewayProcess(cli_env, *DS, tmp=tmp_path, port=port).start()
    url = f"{first.url}/ds/interop/orders"
    try:
        start = node(folder, "produce", url, "0", "3")
        assert start["closed"] is False
        # a follower from the saved offset, by SSE, across the restart below
        follower = follow(folder, url, start["offset"], "4", "sse")
        try:
            node(folder, "produce", url, "3", "2")  # a new epoch: messages 3 and 4
        finally:
            first.stop()
        with GatewayProcess(cli_env, *DS, tmp=tmp_path, port=port):
            end = node(folder, "produce", url, "5", "2", "close")  # 5, 6, then closed
            assert end["closed"] is True
            read, err = what_it_read(follower)
            # what the client warned of (its SSE fallback) says why a read ended early
            assert read["messages"] == [{"n": n} for n in (3, 4, 5, 6)], err[-3000:]
            everything = node(folder, "follow", url, "-1", "7", "long-poll")
            assert everything["messages"] == [{"n": n} for n in range(7)]
            assert everything["offset"] == end["offset"]
    finally:
        if first.process is not None and first.process.poll() is None:
            first.stop()


class SseCounted:
    """An ASGI application, counting the event streams asked of it; `loop` is the event
    loop serving it (from its first request on)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.asked = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.loop = asyncio.get_running_loop()
            if b"live=sse" in scope["query_string"]:
                self.asked += 1
        await self.app(scope, receive, send)


def ds_gateway(dsn: str) -> SseCounted:
    config = GatewayConfig(durable_streams=True, durable_streams_long_poll=2)
    return SseCounted(create_app(config, dsn=dsn))


def test_the_typescript_client_follows_on_through_a_gateway_held_stopping(dsn: str) -> None:
    """A stopping gateway ends its event streams at the stop signal but takes requests
    until its listener closes (a moment, longer on a busy machine). Held there: the SSE
    follower's reconnections must not get event streams that end at once, which the
    client counts as a proxy cutting it short; after three in a row it falls back to
    long-poll, and that fallback ends its read as if the stream were done (the restart
    test above then ended with [3, 4])."""
    folder = suite_folder()
    port = free_port()
    url = f"http://127.0.0.1:{port}/ds/interop/held"
    first = ds_gateway(dsn)
    with serving(first, port, lifespan="on"):
        start = node(folder, "produce", url, "0", "3")
        follower = follow(folder, url, start["offset"], "4", "sse")
        try:
            node(folder, "produce", url, "3", "2")
            wait_for(lambda: first.asked >= 1, "the follower's event stream")
            asked = first.asked
            assert first.loop is not None
            first.loop.call_soon_threadsafe(close_all_streams)  # what SIGTERM does first
            # long enough for three reconnections in a row, or the client's giving up
            wait_for(
                lambda: follower.poll() is not None or first.asked >= asked + 4,
                "the follower's reconnections to the stopping gateway",
            )
        except BaseException:
            follower.kill()
            follower.wait()
            raise
    with serving(ds_gateway(dsn), port, lifespan="on"):
        try:
            node(folder, "produce", url, "5", "2", "close")
        except BaseException:
            follower.kill()
            follower.wait()
            raise
        read, err = what_it_read(follower)
    assert read["messages"] == [{"n": n} for n in (3, 4, 5, 6)], err[-3000:]


def test_the_typescript_client_forks_a_stream_and_reads_the_fork_stitched(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    folder = suite_folder()
    with GatewayProcess(cli_env, *DS, tmp=tmp_path) as gateway:
        source = f"{gateway.url}/ds/interop/chat"
        fork_point = node(folder, "produce", source, "0", "3")["offset"]
        node(folder, "produce", source, "3", "2")  # 3 and 4: the source's own, after it

        fork = f"{gateway.url}/ds/interop/chat-fork"
        forked = node(folder, "fork", fork, "/interop/chat", fork_point)
        assert forked["contentType"] == "application/json"  # inherited
        expected = [{"n": 0}, {"n": 1}, {"n": 2}, {"n": "fork"}]
        assert forked["messages"] == expected
        followed = node(folder, "follow", fork, "-1", "4", "sse")
        assert followed["messages"] == expected
        assert followed["offset"] == forked["offset"]
        # from the fork point, by long-poll: the fork's own only, never the source's
        follower = follow(folder, fork, fork_point, "2", "long-poll")
        try:
            node(folder, "produce", source, "5", "1")
            later = web.post(fork, headers={"Content-Type": "application/json"}, content=b'"later"')
            assert later.status_code == 204
        except BaseException:
            follower.kill()
            follower.wait()
            raise
        assert what_it_read(follower)[0]["messages"] == [{"n": "fork"}, "later"]

        # at the source's tail, named by its whole URL path
        whole = node(folder, "fork", f"{gateway.url}/ds/interop/chat-all", "/ds/interop/chat")
        assert whole["messages"] == [{"n": n} for n in range(6)] + [{"n": "fork"}]


def test_the_python_client_appends_subscribes_and_resumes(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    with GatewayProcess(cli_env, *DS, tmp=tmp_path, port=port) as gateway:
        url = f"{gateway.url}/ds/interop/python"
        handle = DurableStream.create(url, content_type="application/json", batching=False)
        for n in range(3):
            handle.append({"n": n})
        with handle.stream(live=False) as page:
            assert list(page.iter_json()) == [{"n": 0}, {"n": 1}, {"n": 2}]
            saved = page.offset
        for live in ("long-poll", "sse"):
            later = {"n": live}
            tail = handle.head().offset
            appender = threading.Timer(0.3, handle.append, args=(later,))
            appender.start()
            with handle.stream(offset=tail, live=live) as session:
                first = next(iter(session.iter_json()))
            appender.join()
            assert first == later
        handle.close()
    with GatewayProcess(cli_env, *DS, tmp=tmp_path, port=port) as restarted:
        handle = DurableStream(f"{restarted.url}/ds/interop/python", batching=False)
        with handle.stream(offset=saved, live=False) as resumed:
            assert list(resumed.iter_json()) == [{"n": "long-poll"}, {"n": "sse"}]
        text = DurableStream.create(
            f"{restarted.url}/ds/interop/text", content_type="text/plain", batching=False
        )
        text.append("line one\r\n")
        text.append("and ünïcode\n")
        with text.stream(live=False) as read:
            assert read.read_text() == "line one\r\nand ünïcode\n"
