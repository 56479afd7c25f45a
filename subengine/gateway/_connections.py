"""The open connections of a gateway process, by kind and by principal.

Every pull, long-poll and event stream holds a `Slot` while it is served; the counts are
what `/metrics` shows. They are per process: `--workers N` runs N sets of counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

# What a connection is: a page, a long-poll, an event stream of one stream, a watch.
PULL, LONG_POLL, SSE, WATCH = "pull", "long_poll", "sse", "watch"
KINDS = (PULL, LONG_POLL, SSE, WATCH)
# Connections that stay open, counted per principal.
HELD_OPEN = frozenset({LONG_POLL, SSE, WATCH})
# Until API keys identify callers, everyone is this one principal.
ANONYMOUS = "anonymous"


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
    """Counts of open connections."""

    def __init__(self) -> None:
        self.by_kind: Counter[str] = Counter({kind: 0 for kind in KINDS})
        self.by_principal: Counter[str] = Counter()

    def admit(self, kind: str, principal: str) -> Slot:
        """A slot for a new connection of `kind` by `principal`."""
        self.by_kind[kind] += 1
        if kind in HELD_OPEN:
            self.by_principal[principal] += 1
        return Slot(self, kind, principal)

    def _release(self, slot: Slot) -> None:
        self.by_kind[slot.kind] -= 1
        if slot.kind in HELD_OPEN:
            self.by_principal[slot.principal] -= 1
            if not self.by_principal[slot.principal]:
                del self.by_principal[slot.principal]
