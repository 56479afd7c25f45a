"""Both official Durable Streams clients against a real `subengine serve --durable-streams`
(docs/durable-streams.md): the TypeScript one (`@durable-streams/client`, run by
tests/conformance/interop.mjs; skipped without node and npm) and the Python one
(`durable-streams` from PyPI). They create streams, append (the TypeScript one through
its idempotent producer, and closes), subscribe by SSE and long-poll, resume from a
saved offset, and carry on across a restart of the gateway; the TypeScript one forks a
stream (its create() with the fork headers: it has no call of its own for it) and reads
the fork."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from ds_suite import suite_folder
from durable_streams import DurableStream
from helpers import GatewayProcess, free_port

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
        follower = subprocess.Popen(
            ["node", "interop.mjs", "follow", url, start["offset"], "4", "sse"],
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            node(folder, "produce", url, "3", "2")  # a new epoch: messages 3 and 4
        finally:
            first.stop()
        with GatewayProcess(cli_env, *DS, tmp=tmp_path, port=port):
            end = node(folder, "produce", url, "5", "2", "close")  # 5, 6, then closed
            assert end["closed"] is True
            out, err = follower.communicate(timeout=CLIENT_SECONDS)
            assert follower.returncode == 0, err[-3000:]
            followed = json.loads(out.strip().splitlines()[-1])
            assert followed["messages"] == [{"n": n} for n in (3, 4, 5, 6)]
            everything = node(folder, "follow", url, "-1", "7", "long-poll")
            assert everything["messages"] == [{"n": n} for n in range(7)]
            assert everything["offset"] == end["offset"]
    finally:
        if first.process is not None and first.process.poll() is None:
            first.stop()


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
        follower = subprocess.Popen(
            ["node", "interop.mjs", "follow", fork, fork_point, "2", "long-poll"],
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            node(folder, "produce", source, "5", "1")
            later = httpx.post(
                fork, headers={"Content-Type": "application/json"}, content=b'"later"'
            )
            assert later.status_code == 204
            out, err = follower.communicate(timeout=CLIENT_SECONDS)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
        assert follower.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["messages"] == [{"n": "fork"}, "later"]

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
