"""subengine: partitioned event streams in PostgreSQL, consumed exactly once.

import subengine
engine = subengine.Engine()          # SUBENGINE_DSN, or an embedded PostgreSQL
engine.migrate()
engine.create_stream("orders", partitions=8)
engine.append("orders", [subengine.NewEvent("order-1", "OrderPlaced", {"total": 10})])
"""

from subengine._app import App, Subscription
from subengine._append import append
from subengine._engine import Engine
from subengine._errors import (
    ConfigurationError,
    DatabaseUnavailable,
    EventIdConflict,
    Fenced,
    InvalidEvent,
    InvalidInput,
    MigrationError,
    PartitionNotFound,
    PositionsMissing,
    SchemaNotReady,
    StreamExists,
    StreamNotFound,
    SubengineError,
    SubscriptionMismatch,
    SubscriptionNotFound,
    WrongExpectedVersion,
)
from subengine._events import Appended, Event, NewEvent, PartitionState, Stream, partition_for
from subengine._orm import sqlalchemy_session
from subengine._records import (
    DeadLetter,
    PartitionStatus,
    StoredSubscription,
    SubscriptionSummary,
    WorkerRegistration,
    WorkerStatus,
)
from subengine._reset import reset_subscription
from subengine._settings import Settings
from subengine._subscriptions import BatchOutcome, SubscriptionPosition

__all__ = [
    "App",
    "Appended",
    "BatchOutcome",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DeadLetter",
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
    "SchemaNotReady",
    "Settings",
    "StoredSubscription",
    "Stream",
    "StreamExists",
    "StreamNotFound",
    "SubengineError",
    "Subscription",
    "SubscriptionMismatch",
    "SubscriptionNotFound",
    "SubscriptionPosition",
    "SubscriptionSummary",
    "WorkerRegistration",
    "WorkerStatus",
    "WrongExpectedVersion",
    "append",
    "partition_for",
    "reset_subscription",
    "sqlalchemy_session",
]
