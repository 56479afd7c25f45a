"""A tiny Server-Sent Events server, for the test of the browser fixture.

Listens on a free loopback port and prints it, then prints one JSON line per request it
receives: {"path", "last_event_id"} (null when the request had no Last-Event-ID header).
GET /events without a Last-Event-ID asks for reconnects after 100 ms, sends the events
1 "first" and 2 "second", and ends the stream by closing the connection; with one it
answers 204 No Content, which tells an EventSource to stop reconnecting. Anything else
is a 404.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STREAM = b"retry: 100\n\nid: 1\ndata: first\n\nid: 2\ndata: second\n\n"
_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.0, so a response without a Content-Length ends when the connection closes
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        last_event_id = self.headers.get("Last-Event-ID")
        say(json.dumps({"path": self.path, "last_event_id": last_event_id}))
        if self.path != "/events":
            self.send_error(404)
        elif last_event_id is not None:
            self.send_response(204)
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(STREAM)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the JSON lines are the log."""


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    say(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
