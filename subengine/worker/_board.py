"""What the poller knows of where work may have come (the board of suspects), and the
wake-up that idle slots wait on; both shared by the poller and the slots of one worker."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from subengine.model._declarations import Subscription


class Board:
    """What the poller knows of where work may have come: the head of every partition of
    the streams the worker reads, and the suspects, the (subscription, partition) pairs
    whose partition grew since a look last checked them (or whole subscriptions, after a
    (re)connection, when anything may have happened). Shared by the poller, which adds
    suspects, and the slots, whose looks take them."""

    def __init__(self, subscriptions: Sequence[Subscription]) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, list[str]] = {}
        for subscription in subscriptions:
            self._names.setdefault(subscription.stream, []).append(subscription.name)
        self._heads: dict[tuple[str, int], int] = {}
        self._pairs: set[tuple[str, int]] = set()
        self._whole: set[str] = set()
        # suspects whose rows a batch held when a look came: for the look after a batch
        # ends or after the next poll, not the very next one (which would only spin)
        self._deferred: set[tuple[str, int]] = set()
        # heads that grew so far, and when each partition's head last grew (that count)
        self._news = 0
        self._grown: dict[tuple[str, int], int] = {}

    @property
    def streams(self) -> list[str]:
        return sorted(self._names)

    def grew(self, stream: str, partition: int, head: int) -> bool:
        """A partition's head is at least `head` (a notification): whether that is news,
        in which case its pairs are suspects."""
        with self._lock:
            return self._grew(stream, partition, head)

    def _grew(self, stream: str, partition: int, head: int) -> bool:
        names = self._names.get(stream)
        known = self._heads.get((stream, partition), 0)
        if names is None or head <= known:
            return False
        self._heads[stream, partition] = head
        self._news += 1
        self._grown[stream, partition] = self._news
        self._pairs.update((name, partition) for name in names)
        return True

    def news(self) -> int:
        """How many heads grew so far: for `grew_since`."""
        with self._lock:
            return self._news

    def grew_since(self, name: str, stream: str, partitions: Sequence[int], news: int) -> bool:
        """Partitions of subscription `name` a batch moved (or tried to): those whose head
        grew since `news` (a `news()` from before the batch) become suspects again;
        whether any did. The batch stored their next_time (NULL when drained) from a
        snapshot that may predate those appends, and a look that took them as suspects
        before its commit saw their rows as they were (a next_time, so nothing to mark)
        and dropped them: with no later append, no look would ever find their events."""
        with self._lock:
            again = [
                (name, partition)
                for partition in partitions
                if self._grown.get((stream, partition), 0) > news
            ]
            self._pairs.update(again)
            return bool(again)

    def heads_read(self, heads: list[tuple[str, int, int]], everything: bool) -> bool:
        """Every head of some streams, read from the database: the partitions that grew
        become suspects (all pairs when `everything`: nothing is known); whether any did."""
        with self._lock:
            grown = [self._grew(stream, partition, head) for stream, partition, head in heads]
            if everything:
                for names in self._names.values():
                    self._whole.update(names)
            return any(grown) or everything

    def differs(self, totals: dict[str, int]) -> list[str]:
        """The streams whose sum of heads in the database is not the one known: some
        of their partitions grew without a notification (yet)."""
        with self._lock:
            known = dict.fromkeys(self._names, 0)
            for (stream, _), head in self._heads.items():
                known[stream] += head
            return [s for s in self._names if totals.get(s, 0) != known[s]]

    def take(
        self, others: Collection[tuple[str, int]] = ()
    ) -> tuple[list[tuple[str, int]], list[str]]:
        """The suspects, for a look, which is now responsible for them: all but those of
        partitions whose lock another slot of the worker holds (`others`), which stay for
        that slot (it takes them, or looks, as soon as it can; a look here could not
        lock them, and would leave that slot waiting for a poll)."""
        with self._lock:
            pairs = sorted(p for p in self._pairs if p not in others)
            whole = sorted(self._whole)
            self._pairs.difference_update(pairs)
            self._whole.clear()
            return pairs, whole

    def take_few(
        self,
        limit: int,
        mine: tuple[str, int] | None = None,
        others: Collection[tuple[str, int]] = (),
    ) -> list[tuple[str, int]]:
        """Up to `limit` suspects, for a slot that takes them without a look, when the
        suspects are only pairs (a notification's, not a reconnection's): first `mine`,
        the partition whose lock the slot holds, and none whose lock another slot of the
        worker holds (`others`: that slot takes them, without a lock statement). The
        others stay for the other slots and the looks."""
        with self._lock:
            if self._whole or not self._pairs:
                return []
            first = [mine] if mine in self._pairs else []
            rest = sorted(p for p in self._pairs if p != mine and p not in others)
            pairs = (first + rest)[:limit]
            self._pairs.difference_update(pairs)
            return pairs

    def put_back(self, pairs: Sequence[tuple[str, int]], whole: Sequence[str] = ()) -> None:
        """Suspects a failed look took, for the next one."""
        if pairs or whole:
            with self._lock:
                self._pairs.update(pairs)
                self._whole.update(whole)

    def defer(self, pairs: Sequence[tuple[str, int]]) -> None:
        """Suspects a batch held when a look came."""
        if pairs:
            with self._lock:
                self._deferred.update(pairs)

    def retry_deferred(self) -> bool:
        """Make the deferred suspects suspects again (a batch ended, or a poll came);
        whether there were any."""
        with self._lock:
            if not self._deferred:
                return False
            self._pairs.update(self._deferred)
            self._deferred.clear()
            return True

    def pending(self) -> bool:
        with self._lock:
            return bool(self._pairs or self._whole)

    def pending_for(self, others: Collection[tuple[str, int]]) -> bool:
        """Whether there are suspects for a slot: any but those of partitions whose lock
        another slot of the worker holds (`others`), which are that slot's to take."""
        with self._lock:
            return bool(self._whole) or any(p not in others for p in self._pairs)


class Wakeup:
    """A counter of notifications that idle slots wait on; no wake-up is lost between
    a slot's look for work and its wait, because it waits only if the count is unchanged.
    A second counter says which wake-ups ask every slot to look for work (a poll that
    found some, a reconnection, the worker stopping): the others (an append's
    notification) only put suspects on the board, for the slots that take them."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._count = 0
        self._looks = 0

    def count(self) -> int:
        with self._condition:
            return self._count

    def looks(self) -> int:
        """How many wake-ups so far asked every slot to look."""
        with self._condition:
            return self._looks

    def notify(self, look: bool = True) -> None:
        with self._condition:
            self._count += 1
            self._looks += look
            self._condition.notify_all()

    def wait(self, seen: int, timeout: float | None) -> bool:
        """Wait for a notification after `seen` (at most `timeout` seconds, None: no
        limit); False when the timeout came first."""
        with self._condition:
            if self._count == seen:
                self._condition.wait(timeout)
            return self._count != seen
