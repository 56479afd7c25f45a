"""The exceptions subengine raises; all derive from `SubengineError`.

Messages name the problem and, where there is one, the command or call that fixes it.
"""

from __future__ import annotations

from typing import Protocol


class Gap(Protocol):
    """What an error says of a gap (a `subengine.Tombstone`; this module is below it)."""

    @property
    def stream(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def gap_from(self) -> int: ...

    @property
    def gap_to(self) -> int: ...


class SubengineError(Exception):
    """Base class of every error subengine raises on purpose."""


class ConfigurationError(SubengineError):
    """A setting or connection parameter is invalid."""


class InvalidInput(SubengineError, ValueError):
    """An argument is malformed: a name, a payload, a limit. Nothing was written."""


class InvalidEvent(InvalidInput):
    """One event of an append is malformed; `index` is its place in the call (from 0)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"event {index}: {reason}")
        self.index = index
        self.reason = reason


class StreamNotFound(SubengineError, LookupError):
    """The named stream does not exist."""

    def __init__(self, stream: str) -> None:
        super().__init__(
            f"stream {stream!r} does not exist; create it with "
            f"`subengine stream create {stream} --partitions N`"
        )
        self.stream = stream


class StreamBeingDeleted(StreamNotFound):
    """The stream is being deleted: its events are going, it takes no appends and no new
    subscriptions, and its name cannot be created again until the delete finishes."""

    def __init__(self, stream: str) -> None:
        SubengineError.__init__(
            self,
            f"stream {stream!r} is being deleted; `subengine stream delete {stream}` finishes "
            "an interrupted delete, after which the name can be created again",
        )
        self.stream = stream


class StreamExists(SubengineError):
    """A stream of that name exists already."""

    def __init__(self, stream: str, partitions: int) -> None:
        super().__init__(f"stream {stream!r} exists already, with {partitions} partitions")
        self.stream = stream
        self.partitions = partitions


class PartitionNotFound(SubengineError, LookupError):
    """The partition number is outside the stream's partitions."""

    def __init__(self, stream: str, partition: int, partitions: int) -> None:
        super().__init__(
            f"stream {stream!r} has partitions 0..{partitions - 1}; there is no partition "
            f"{partition}"
        )
        self.stream = stream
        self.partition = partition


class WrongExpectedVersion(SubengineError):
    """A key's current version is not the one the append expected. Nothing was written."""

    def __init__(self, stream: str, key: str, expected: int, actual: int) -> None:
        super().__init__(
            f"key {key!r} in stream {stream!r} is at version {actual}, "
            f"but the append expected version {expected}; nothing was written"
        )
        self.stream = stream
        self.key = key
        self.expected = expected
        self.actual = actual


class EventIdConflict(SubengineError):
    """An event id names another event (another key or type), stored or in the same call."""

    def __init__(self, stream: str, event_id: str, key: str, type: str, *, stored: bool) -> None:
        where = (
            f"is stored in stream {stream!r} already"
            if stored
            else "names two events of one append"
        )
        super().__init__(
            f"event id {event_id} {where}, the first for key {key!r} and type {type!r}; an id "
            "names one event: give a new event a new id"
        )
        self.stream = stream
        self.event_id = event_id
        self.key = key
        self.type = type


class ApiKeyNotFound(SubengineError, LookupError):
    """No API key of the gateway has that id."""

    def __init__(self, key_id: str) -> None:
        super().__init__(
            f"API key {key_id!r} does not exist; `subengine gateway key list` shows the keys"
        )
        self.key_id = key_id


class RetryLater(SubengineError):
    """Raised by a handler: the batch could not be handled now, through nobody's fault
    in its events (a callback that is down, a rate limit); handle the whole batch again
    in `seconds`. The partition waits (its `retry_at`, seen by every worker) and the
    batch is not split; no error policy applies, so it never stops or dead-letters."""

    def __init__(self, seconds: float, reason: str) -> None:
        super().__init__(reason)
        self.seconds = min(max(float(seconds), 0.0), 86_400.0)
        self.reason = reason


class SubscriptionMismatch(SubengineError):
    """The stored subscription of that name reads another stream or began elsewhere."""


class SubscriptionNotFound(SubengineError, LookupError):
    """No subscription of that name is stored."""


class Fenced(SubengineError):
    """A position compare-and-set matched no row: another worker or a reset moved it."""


class LeaseNotFound(SubengineError, LookupError):
    """No lease of a remote worker has that id (in that subscription)."""


class LeaseConflict(SubengineError):
    """A remote worker's lease can no longer do what was asked: it ended (acked,
    released, nacked, or lost when its deadline passed and another claim took its
    partition), its deadline passed, or its subscription's position moved since the claim
    (a reset, another worker). Nothing was changed."""


class DatabaseUnavailable(SubengineError):
    """PostgreSQL could not be reached in time (connect timeout, or a worker's outage
    timeout)."""


class SchemaNotReady(SubengineError):
    """The database schema is missing or older than this code; run the migrations."""


class PositionsMissing(SubengineError, LookupError):
    """Events a subscription has not handled are no longer stored: positions `first` to
    `last` of a partition are gone. The partition stops before them; nothing is skipped."""

    def __init__(
        self, subscription: str, stream: str, partition: int, first: int, last: int
    ) -> None:
        span, them = (
            (f"position {first}", "it")
            if first == last
            else (f"positions {first} to {last}", "them")
        )
        super().__init__(
            f"partition {partition} of stream {stream!r} no longer stores {span}, which "
            f"subscription {subscription!r} has not handled; it stopped before {them}. To go "
            f"on without {them}: subengine subscription reset {subscription} "
            f"--to '{{\"{partition}\": {last}}}'"
        )
        self.subscription = subscription
        self.stream = stream
        self.partition = partition
        self.first = first
        self.last = last


class StoppedAtGap(PositionsMissing):
    """Retention removed events a subscription had not handled (`gap`, a Tombstone),
    and its gap policy is `stop`: the partition stopped before them, in state `gap`."""

    def __init__(self, subscription: str, gap: Gap) -> None:
        super().__init__(subscription, gap.stream, gap.partition, gap.gap_from, gap.gap_to)
        span = (
            f"position {gap.gap_from}"
            if gap.gap_from == gap.gap_to
            else f"positions {gap.gap_from} to {gap.gap_to}"
        )
        self.args = (
            f"retention removed {span} of partition {gap.partition} of stream "
            f"{gap.stream!r} before subscription {subscription!r} handled them; the "
            f"partition stopped before the gap (on_gap='stop'). To go on without them: "
            f"subengine subscription skip-gap {subscription} --partition {gap.partition}",
        )
        self.gap = gap


class MigrationError(SubengineError):
    """The schema could not be created or upgraded; the failed upgrade left nothing behind
    (it runs in one transaction)."""
