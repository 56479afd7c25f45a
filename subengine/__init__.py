"""subengine: partitioned event streams in PostgreSQL, consumed exactly once.

import subengine
engine = subengine.Engine()          # SUBENGINE_DSN, or an embedded PostgreSQL
engine.migrate()
engine.create_stream("orders", partitions=8)
engine.append("orders", [subengine.NewEvent("order-1", "OrderPlaced", {"total": 10})])
"""

from __future__ import annotations

import importlib
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from subengine.engine._async_engine import AsyncEngine
    from subengine.engine._engine import Engine
    from subengine.engine._orm import async_sqlalchemy_session, sqlalchemy_session
    from subengine.model._cursor import Cursor
    from subengine.model._declarations import Retention, Subscription
    from subengine.model._errors import (
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
    from subengine.model._events import (
        Appended,
        Event,
        NewEvent,
        PartitionState,
        Stream,
        Tombstone,
        partition_for,
    )
    from subengine.model._logging import configure_logging
    from subengine.model._records import (
        DeadLetter,
        ParkedEvent,
        ParkedKey,
        PartitionStatus,
        StoredSubscription,
        SubscriptionSummary,
        WorkerRegistration,
        WorkerStatus,
    )
    from subengine.model._settings import Settings
    from subengine.outside._api_keys import ApiKey
    from subengine.streams._append import append
    from subengine.streams._append_async import append_async
    from subengine.streams._read import gateway_cursor
    from subengine.streams._retention import RetentionRun
    from subengine.streams._tail import AsyncTail, Tail
    from subengine.subscriptions._batches import BatchOutcome
    from subengine.subscriptions._parking import ParkedKeyRetry
    from subengine.subscriptions._reset import reset_subscription
    from subengine.subscriptions._stream_deletion import DeletedStream
    from subengine.subscriptions._subscriptions import SubscriptionPosition
    from subengine.worker._app import App
    from subengine.worker._async_worker import AsyncWorker

# Every public name, and the module that defines it. They are imported on first use (PEP
# 562), so `import subengine.client`, which speaks only HTTP, loads neither psycopg nor the
# engine; `from subengine import Engine` works as before.
_PUBLIC: dict[str, str] = {
    "AsyncEngine": "subengine.engine._async_engine",
    "Engine": "subengine.engine._engine",
    "sqlalchemy_session": "subengine.engine._orm",
    "async_sqlalchemy_session": "subengine.engine._orm",
    "Cursor": "subengine.model._cursor",
    "Retention": "subengine.model._declarations",
    "Subscription": "subengine.model._declarations",
    "ApiKeyNotFound": "subengine.model._errors",
    "ConfigurationError": "subengine.model._errors",
    "DatabaseUnavailable": "subengine.model._errors",
    "EventIdConflict": "subengine.model._errors",
    "Fenced": "subengine.model._errors",
    "InvalidEvent": "subengine.model._errors",
    "InvalidInput": "subengine.model._errors",
    "MigrationError": "subengine.model._errors",
    "PartitionNotFound": "subengine.model._errors",
    "PositionsMissing": "subengine.model._errors",
    "RetryLater": "subengine.model._errors",
    "SchemaNotReady": "subengine.model._errors",
    "StoppedAtGap": "subengine.model._errors",
    "StreamBeingDeleted": "subengine.model._errors",
    "StreamExists": "subengine.model._errors",
    "StreamNotFound": "subengine.model._errors",
    "SubengineError": "subengine.model._errors",
    "SubscriptionMismatch": "subengine.model._errors",
    "SubscriptionNotFound": "subengine.model._errors",
    "WrongExpectedVersion": "subengine.model._errors",
    "Appended": "subengine.model._events",
    "Event": "subengine.model._events",
    "NewEvent": "subengine.model._events",
    "PartitionState": "subengine.model._events",
    "Stream": "subengine.model._events",
    "Tombstone": "subengine.model._events",
    "partition_for": "subengine.model._events",
    "configure_logging": "subengine.model._logging",
    "DeadLetter": "subengine.model._records",
    "ParkedEvent": "subengine.model._records",
    "ParkedKey": "subengine.model._records",
    "PartitionStatus": "subengine.model._records",
    "StoredSubscription": "subengine.model._records",
    "SubscriptionSummary": "subengine.model._records",
    "WorkerRegistration": "subengine.model._records",
    "WorkerStatus": "subengine.model._records",
    "Settings": "subengine.model._settings",
    "ApiKey": "subengine.outside._api_keys",
    "append": "subengine.streams._append",
    "append_async": "subengine.streams._append_async",
    "gateway_cursor": "subengine.streams._read",
    "RetentionRun": "subengine.streams._retention",
    "AsyncTail": "subengine.streams._tail",
    "Tail": "subengine.streams._tail",
    "reset_subscription": "subengine.subscriptions._reset",
    "DeletedStream": "subengine.subscriptions._stream_deletion",
    "BatchOutcome": "subengine.subscriptions._batches",
    "ParkedKeyRetry": "subengine.subscriptions._parking",
    "SubscriptionPosition": "subengine.subscriptions._subscriptions",
    "App": "subengine.worker._app",
    "AsyncWorker": "subengine.worker._async_worker",
}

__all__ = [
    "ApiKey",
    "ApiKeyNotFound",
    "App",
    "Appended",
    "AsyncEngine",
    "AsyncTail",
    "AsyncWorker",
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
    "ParkedEvent",
    "ParkedKey",
    "ParkedKeyRetry",
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
    "async_sqlalchemy_session",
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
    from subengine.db import _migrate
    from subengine.model._names import validate_schema_name

    validate_schema_name(schema)
    return _migrate.upgrade_sql(schema)


def stop_embedded(home: str | PathLike[str] | None = None) -> bool:
    """Stop the embedded PostgreSQL whose data is in `home` (default: SUBENGINE_HOME, else
    .subengine), the one an Engine without a DSN starts; False if none was running there."""
    from subengine.db import _embedded
    from subengine.model._settings import Settings

    folder = Settings.from_env().home if home is None else Path(home)
    return _embedded.stop_embedded(folder.expanduser())


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'subengine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
