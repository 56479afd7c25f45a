"""The webhook sink of bench/webhooks.py, a process of its own: a raw asyncio HTTP/1.1
server with keep-alive on 127.0.0.1 that echoes challenges, answers event batches 204 and
records each one's arrival, and hands the records over on a small control endpoint.

    python bench/_sink.py PORT      # until SIGTERM
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from typing import Any

# the sink's status lines
REASONS = {200: b"OK", 204: b"No Content", 404: b"Not Found"}


class Sink:
    """What the sink process received, per subscription."""

    def __init__(self) -> None:
        self.records: dict[str, list[list[Any]]] = {}
        self.counts: dict[str, int] = {}

    def handle(self, method: bytes, path: bytes, body: bytes, at: float) -> tuple[int, bytes]:
        if method == b"POST" and path == b"/hook":
            message = json.loads(body)
            if message.get("type") == "challenge":
                return 200, json.dumps({"challenge": message["challenge"]}).encode()
            subscription = message["subscription"]
            positions = [event["position"] for event in message["events"]]
            self.records.setdefault(subscription, []).append(
                [
                    at,
                    message["partition"],
                    message["after"],
                    message["through"],
                    positions,
                    len(body),
                ]
            )
            self.counts[subscription] = self.counts.get(subscription, 0) + len(positions)
            return 204, b""
        subscription = path.rpartition(b"/")[2].decode()
        if method == b"GET" and path.startswith(b"/count/"):
            return 200, str(self.counts.get(subscription, 0)).encode()
        if method == b"POST" and path.startswith(b"/take/"):
            self.counts.pop(subscription, None)
            return 200, json.dumps(self.records.pop(subscription, [])).encode()
        if path == b"/healthz":
            return 200, b"ok"
        return 404, b""


class SinkConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the sink (Content-Length bodies only)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            method, path = lines[0].split(b" ")[:2]
            status, answer = self.sink.handle(method, path, body, time.monotonic())
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n"
                % (status, REASONS[status], len(answer))
                + answer
            )


def run_sink(port: int) -> None:
    async def serve() -> None:
        sink = Sink()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: SinkConnection(sink), "127.0.0.1", port)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(serve())


if __name__ == "__main__":
    run_sink(int(sys.argv[1]))
