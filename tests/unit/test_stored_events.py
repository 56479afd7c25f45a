"""Events built from stored rows: their data and metadata stay JSON text until read, and
nothing a user can do with an Event tells them from events built with decoded values.
No database."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from helpers import count_json_decodes

import subengine
from subengine.model._events import stored_events

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
ID = uuid.UUID("01890a5d-ac96-774b-bcce-b302099a8057")


def row(data: str = '{"total": 5, "items": [1, 2]}', metadata: str = '{"by": "me"}') -> Any:
    return (ID, "orders", 3, 7, "order-1", 2, "Placed", data, metadata, NOW, NOW)


def decoded(**changes: Any) -> subengine.Event:
    fields: dict[str, Any] = {
        "id": ID, "stream": "orders", "partition": 3, "position": 7, "key": "order-1",
        "key_version": 2, "type": "Placed", "data": {"total": 5, "items": [1, 2]},
        "metadata": {"by": "me"}, "occurred_at": NOW, "recorded_at": NOW,
    }  # fmt: skip
    return subengine.Event(**{**fields, **changes})


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return count_json_decodes(monkeypatch)


def test_data_and_metadata_are_decoded_when_first_read(decodes: list[str]) -> None:
    [event] = stored_events([row()])
    assert decodes == []
    assert event.data == {"total": 5, "items": [1, 2]}
    assert event.data is event.data
    assert decodes == ['{"total": 5, "items": [1, 2]}']
    assert event.metadata == {"by": "me"}
    assert len(decodes) == 2


def test_a_stored_event_is_the_event_of_its_decoded_values() -> None:
    [event] = stored_events([row()])
    assert type(event) is subengine.Event
    assert event == decoded() and decoded() == event
    assert event != decoded(data={"total": 6})
    [other] = stored_events([row()])
    assert repr(other) == repr(decoded())
    [other] = stored_events([row()])
    assert dataclasses.asdict(other) == dataclasses.asdict(decoded())
    [other] = stored_events([row()])
    assert dataclasses.replace(other, payload=1) == decoded(payload=1)
    for copied in (pickle.loads(pickle.dumps(stored_events([row()])[0])), copy.copy(event)):
        assert copied == decoded()
    assert event.payload is None


def test_json_that_is_not_an_object_decodes_to_its_value() -> None:
    [text, number, nothing] = stored_events([row('"hi"'), row("1.5"), row("null")])
    assert (text.data, number.data, nothing.data) == ("hi", 1.5, None)


def test_a_stored_event_stays_frozen() -> None:
    [event] = stored_events([row()])
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.data = {}  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.metadata = {}  # type: ignore[misc]
    assert event.data == {"total": 5, "items": [1, 2]}
