"""The errors a reader raises: the gateway said no, and retrying would not change that."""

from __future__ import annotations

from subengine.model._errors import SubengineError

# how much of a gateway's message an error repeats
_MESSAGE_CHARS = 500


class GatewayError(SubengineError):
    """The gateway refused a request (a 4xx answer) or ended an event stream with an
    error that resuming cannot cure (a `close` frame such as `stream_not_found`).

    `status` is the HTTP status (None for a `close` frame); `code` and `message` are
    the gateway's own (docs/gateway.md, "Errors"). The request's credentials are never
    part of it."""

    def __init__(self, status: int | None, code: str, message: str) -> None:
        self.status = status
        self.code = code
        self.message = message[:_MESSAGE_CHARS]
        answered = "ended the stream with" if status is None else f"answered {status}"
        super().__init__(f"the gateway {answered} {code}: {self.message}")
