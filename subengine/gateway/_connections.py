"""The open connections of a gateway process, by kind and by principal, and its limits.

Every pull, long-poll and event stream holds a `Slot` while it is served; the counts are
what `/metrics` shows and what the limits check (DESIGN.md, the gateway's safety: limits
answered with 429 and Retry-After). Limits are per process: `--workers N` multiplies them.
A long-poll that names its subscriber's session ends that session's older long-poll
(`Sessions`), so a retrying subscriber never holds two (seed 003).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

# What a connection is: a page, a long-poll, an event stream of one stream, a watch.
PULL, LONG_POLL, SSE, WATCH = "pull", "long_poll", "sse", "watch"
KINDS = (PULL, LONG_POLL, SSE, WATCH)
# Connections that stay open: a principal may hold `max_per_principal` of them.
HELD_OPEN = frozenset({LONG_POLL, SSE, WATCH})
# Event streams: the process holds at most `max_event_streams` of them.
EVENT_STREAMS = frozenset({SSE, WATCH})
# Until API keys identify callers, everyone is this one principal.
ANONYMOUS = "anonymous"


# The limits, by the error code of a refusal.
LIMITS = ("too_many_connections", "too_many_event_streams")


class Busy(Exception):
    """A limit is reached: answer 429, asking to come back after `retry_after` seconds."""

    def __init__(self, code: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False)
class Slot:
    """One admitted connection; `release` (once, or more: the later calls do nothing)
    gives its place back."""

    connections: Connections
    kind: str
    principal: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.connections._release(self)


class Connections:
    """Counts of open connections, and the limits on them."""

    def __init__(self, max_per_principal: int, max_event_streams: int, retry_after: int) -> None:
        self.max_per_principal = max_per_principal
        self.max_event_streams = max_event_streams
        self.retry_after = retry_after
        self.by_kind: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self.by_principal: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter({code: 0 for code in LIMITS})

    def admit(self, kind: str, principal: str) -> Slot:
        """A slot for a new connection of `kind` by `principal`; raises Busy when a limit
        is reached."""
        if kind in HELD_OPEN and self.by_principal[principal] >= self.max_per_principal:
            # with no API key in the database, every caller is one principal
            holder = (
                "requests without an API key hold" if principal == ANONYMOUS else "this key holds"
            )
            self._refuse(
                "too_many_connections",
                f"{holder} {self.max_per_principal} open long-polls and event streams, "
                "the most allowed per gateway process (--max-connections-per-key); close "
                "one or retry later",
            )
        if kind in EVENT_STREAMS and self.event_streams() >= self.max_event_streams:
            self._refuse(
                "too_many_event_streams",
                f"this gateway process serves {self.max_event_streams} event streams, its "
                "most; retry later (another gateway process may have room)",
            )
        self.by_kind[kind] += 1
        if kind in HELD_OPEN:
            self.by_principal[principal] += 1
        return Slot(self, kind, principal)

    def event_streams(self) -> int:
        return sum(self.by_kind[kind] for kind in EVENT_STREAMS)

    def _refuse(self, code: str, message: str) -> None:
        self.rejected[code] += 1
        # spread out the retries of many clients refused at once
        raise Busy(code, message, random.randint(self.retry_after, 2 * self.retry_after))

    def _release(self, slot: Slot) -> None:
        self.by_kind[slot.kind] -= 1
        if slot.kind in HELD_OPEN:
            self.by_principal[slot.principal] -= 1
            if not self.by_principal[slot.principal]:
                del self.by_principal[slot.principal]


# How long a long-poll waits at most for the older long-poll of its session to answer
# (it answers at once, unless a read of PostgreSQL is under way).
_SUPERSEDE_SECONDS = 5.0


class Session:
    """One in-flight long-poll of a session: `superseded` is set when a newer one of the
    same session arrives, `ended` once this one has answered (and given its slot back)."""

    def __init__(self) -> None:
        self.superseded = asyncio.Event()
        self.ended = asyncio.Event()


class Sessions:
    """The in-flight long-poll of each (principal, session) of a gateway process."""

    def __init__(self) -> None:
        self._polls: dict[tuple[str, str], Session] = {}

    async def enter(self, principal: str, session: str) -> Session:
        """The long-poll of `session` from now on: its older one answers at once, and
        this returns once it has (its place in the key's limit is free again)."""
        poll = Session()
        older = self._polls.get((principal, session))
        self._polls[(principal, session)] = poll
        if older is not None and not older.ended.is_set():
            older.superseded.set()
            try:
                await asyncio.wait_for(older.ended.wait(), _SUPERSEDE_SECONDS)
            except TimeoutError:
                pass  # the limit then counts both, as it would without a session
        return poll

    def leave(self, principal: str, session: str, poll: Session) -> None:
        poll.ended.set()
        if self._polls.get((principal, session)) is poll:
            del self._polls[(principal, session)]
