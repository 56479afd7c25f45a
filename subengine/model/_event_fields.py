"""Which fields of an event a gateway read carries (docs/gateway.md, "Reading events",
`fields`).

A reader that needs an event's data and place, and nothing else, asks for those: its
pages and frames then come near the size of the data, instead of about 300 bytes of
ids, versions and times per event that it would decode only to drop. An event's place
(`partition` and `position`) comes in every read, whatever was asked for: a client
drops the positions it has seen by it (DESIGN.md, the gateway's reads)."""

from __future__ import annotations

from collections.abc import Iterable

from subengine.model._errors import InvalidInput

# in the order an event's JSON has them
EVENT_FIELDS = (
    "stream",
    "partition",
    "position",
    "id",
    "key",
    "key_version",
    "type",
    "metadata",
    "occurred_at",
    "recorded_at",
    "data",
)
ALL_FIELDS = frozenset(EVENT_FIELDS)
PLACE = frozenset({"partition", "position"})
WITHOUT_DATA = ALL_FIELDS - {"data"}


def fields_of(names: Iterable[str]) -> frozenset[str]:
    """The fields a read asking for `names` carries: those, and the event's place."""
    found = set(PLACE)
    for name in names:
        if not isinstance(name, str):
            raise InvalidInput(f"an event field is a name (text), not {name!r}"[:120])
        if name not in ALL_FIELDS:
            shown = repr(name) if len(name) <= 40 else repr(name[:40]) + "..."
            raise InvalidInput(
                f"unknown event field {shown} in fields: they are {', '.join(EVENT_FIELDS)}"
            )
        found.add(name)
    return ALL_FIELDS if found == ALL_FIELDS else frozenset(found)


def read_fields(names: Iterable[str] | None, include_data: bool | None) -> frozenset[str]:
    """The fields of a read that asked for `names` (None: it did not say) or said
    `include_data` (None: it did not say), which was there before `fields`."""
    if names is None:
        return WITHOUT_DATA if include_data is False else ALL_FIELDS
    if include_data is not None:
        raise InvalidInput("give fields or include_data, not both: leave data out of fields")
    return fields_of(names)


def split_fields(values: Iterable[str]) -> list[str]:
    """The names of query parameters `fields=a,b` (repeatable); empty names are skipped,
    so `fields=` asks for the place alone."""
    return [name for value in values for name in value.split(",") if name]


def fields_text(fields: frozenset[str]) -> str:
    """`fields` as a query parameter's value, in the events' order."""
    return ",".join(name for name in EVENT_FIELDS if name in fields)
