"""subengine: partitioned event streams in PostgreSQL, consumed exactly once.

import subengine
engine = subengine.Engine()          # SUBENGINE_DSN, or an embedded PostgreSQL
engine.migrate()
engine.create_stream("orders", partitions=8)
engine.append("orders", [subengine.NewEvent("order-1", "OrderPlaced", {"total": 10})])
"""

from os import PathLike
from pathlib import Path

from subengine import _embedded, _migrate
from subengine._app import App
from subengine._append import append
from subengine._append_async import append_async
from subengine._async_engine import AsyncEngine
from subengine._cursor import Cursor
from subengine._declarations import Retention, Subscription
from subengine._engine import Engine
from subengine._errors import (
    ApiKeyNotFound,
    ConfigurationError,
    DatabaseUnavailable,
    EventIdConflict,
    Fenced,
    InvalidEvent,
    InvalidInput,
    MigrationError,
    PartitionNotFound,
    PositionsMissing,
    RetryLater,
    SchemaNotReady,
    StoppedAtGap,
    StreamBeingDeleted,
    StreamExists,
    StreamNotFound,
    SubengineError,
    SubscriptionMismatch,
    SubscriptionNotFound,
    WrongExpectedVersion,
)
from subengine._events import (
    Appended,
    Event,
    NewEvent,
    PartitionState,
    Stream,
    Tombstone,
    partition_for,
)
from subengine._gateway_keys import ApiKey
from subengine._logging import configure_logging
from subengine._names import validate_schema_name
from subengine._orm import sqlalchemy_session
from subengine._read import gateway_cursor
from subengine._records import (
    DeadLetter,
    PartitionStatus,
    StoredSubscription,
    SubscriptionSummary,
    WorkerRegistration,
    WorkerStatus,
)
from subengine._reset import reset_subscription
from subengine._retention import RetentionRun
from subengine._settings import Settings
from subengine._stream_deletion import DeletedStream
from subengine._subscriptions import BatchOutcome, SubscriptionPosition
from subengine._tail import AsyncTail, Tail

__all__ = [
    "ApiKey",
    "ApiKeyNotFound",
    "App",
    "Appended",
    "AsyncEngine",
    "AsyncTail",
    "BatchOutcome",
    "ConfigurationError",
    "Cursor",
    "DatabaseUnavailable",
    "DeadLetter",
    "DeletedStream",
    "Engine",
    "Event",
    "EventIdConflict",
    "Fenced",
    "InvalidEvent",
    "InvalidInput",
    "MigrationError",
    "NewEvent",
    "PartitionNotFound",
    "PartitionState",
    "PartitionStatus",
    "PositionsMissing",
    "Retention",
    "RetentionRun",
    "RetryLater",
    "SchemaNotReady",
    "Settings",
    "StoppedAtGap",
    "StoredSubscription",
    "Stream",
    "StreamBeingDeleted",
    "StreamExists",
    "StreamNotFound",
    "SubengineError",
    "Subscription",
    "SubscriptionMismatch",
    "SubscriptionNotFound",
    "SubscriptionPosition",
    "SubscriptionSummary",
    "Tail",
    "Tombstone",
    "WorkerRegistration",
    "WorkerStatus",
    "WrongExpectedVersion",
    "append",
    "append_async",
    "configure_logging",
    "gateway_cursor",
    "migration_sql",
    "partition_for",
    "reset_subscription",
    "sqlalchemy_session",
    "stop_embedded",
]


def migration_sql(schema: str = "subengine") -> str:
    """The SQL that creates subengine's schema `schema` on an empty database (what
    `Engine.migrate` runs), for a DBA to review and apply; it connects to no database."""
    validate_schema_name(schema)
    return _migrate.upgrade_sql(schema)


def stop_embedded(home: str | PathLike[str] | None = None) -> bool:
    """Stop the embedded PostgreSQL whose data is in `home` (default: SUBENGINE_HOME, else
    .subengine), the one an Engine without a DSN starts; False if none was running there."""
    folder = Settings.from_env().home if home is None else Path(home)
    return _embedded.stop_embedded(folder.expanduser())
