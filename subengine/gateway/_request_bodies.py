"""Reading a request body within a limit, for both surfaces of the gateway (`/v1` and
Durable Streams): a body over the limit is refused so that its client reads the refusal.

A server that answers before it has read the body counts the connection idle from its
answer: uvicorn (with any number of workers) reads and throws away the rest of the body
as it comes, but closes the connection if nothing comes within its keep-alive timeout
(5 s, a short stall of a client under load), and a client still sending then sees a
reset or a broken pipe instead of the 413. So a body over the limit is read to its end,
and thrown away as it comes, before the answer: uvicorn sets no timeout on that read.
"""

from __future__ import annotations

from starlette.requests import Request

MIB = 1 << 20
# How far past its limit a body is still read, to be thrown away, so that its client reads
# the 413: well above the default limit (1 MiB) and the 10 MiB the Durable Streams
# conformance suite sends, yet bounded, since each byte of it is work for nothing. A body
# declared larger is refused at once and its connection closed.
DISCARDED_AT_MOST = 16 * MIB


class BodyTooLarge(Exception):
    """A request body over `limit` bytes. When `close`, the rest of it was not read, and
    the answer must close the connection (`headers`)."""

    def __init__(self, limit: int, close: bool) -> None:
        super().__init__(f"the body is larger than {limit} bytes")
        self.limit = limit
        self.close = close

    @property
    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close else {}


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The request's body, or BodyTooLarge if it is over `limit` bytes: read to its end
    first when it is at most DISCARDED_AT_MOST over, else refused at once (by its
    Content-Length, or as it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdecimal():
        length = int(declared)
        # a client that waits for `100 Continue` has sent nothing yet: it is told at once
        waits = request.headers.get("expect", "").lower() == "100-continue"
        if length > limit + DISCARDED_AT_MOST or (length > limit and waits):
            raise BodyTooLarge(limit, close=True)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + DISCARDED_AT_MOST:
            raise BodyTooLarge(limit, close=True)
        if size > limit:
            chunks.clear()
        else:
            chunks.append(chunk)
    if size > limit:
        raise BodyTooLarge(limit, close=False)
    return b"".join(chunks)
