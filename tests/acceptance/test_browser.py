"""The `page` fixture: a real Chromium whose EventSource talks to a real server.

The server is `tests/apps/sse_server.py`, a process of its own: two events with ids, then
the end of the stream, then 204 No Content to the reconnect. What the gateway's tests
will check of its streams, this checks of the browser: it receives, it reconnects by
itself, and it resumes from the last id it received.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from collections.abc import Iterator
from typing import IO, Any

import pytest
from helpers import APPS, PYTHON, PageEventSource, wait_for
from playwright.sync_api import Page

# Each wait of this test, in seconds: a start, a stream, a reconnect, a line of the log.
WAIT = 15.0


class SseServer:
    """tests/apps/sse_server.py as a process, and the requests it reports."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()
        self.port = int(self._next_line("its port"))

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self.lines.put(line.rstrip("\n"))

    def _next_line(self, what: str) -> str:
        try:
            return self.lines.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"the SSE server did not print {what}") from None

    def requests(self, path: str, count: int) -> list[dict[str, Any]]:
        """The first `count` requests it received for `path`, waiting for them."""
        seen: list[dict[str, Any]] = []
        while len(seen) < count:
            request = json.loads(self._next_line(f"request {len(seen) + 1} of {path}"))
            if request["path"] == path:
                seen.append(request)
        return seen


@pytest.fixture
def sse_server() -> Iterator[SseServer]:
    process = subprocess.Popen(
        [PYTHON, str(APPS / "sse_server.py")], stdout=subprocess.PIPE, text=True
    )
    try:
        yield SseServer(process)
    finally:
        process.terminate()
        process.wait(timeout=WAIT)


def test_event_source_reconnects_with_the_last_event_id(page: Page, sse_server: SseServer) -> None:
    source = PageEventSource(page, f"http://127.0.0.1:{sse_server.port}/events")

    wait_for(lambda: source.state() == "closed", "the EventSource to give up on the 204", WAIT)

    assert [(m["id"], m["data"]) for m in source.messages()] == [("1", "first"), ("2", "second")]
    first, reconnect = sse_server.requests("/events", 2)
    assert first["last_event_id"] is None
    assert reconnect["last_event_id"] == "2"
    assert source.counts() == (1, 2)  # one stream opened; it ended, then the 204 failed it
