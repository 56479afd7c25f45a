"""The gateway writes an event's stream, key and type with a fast encoder: the same text as
its `dumps` (JSON's own escapes only, everything else as it is), for every character."""

from __future__ import annotations

from subengine.gateway._hub import _text, dumps


def test_every_character_is_written_as_dumps_writes_it() -> None:
    characters = [chr(c) for c in range(0x3000)] + [
        "\u2028",
        "\u2029",
        "\ufeff",
        "😀",
        "\U0010ffff",
    ]
    characters = [c for c in characters if not 0xD800 <= ord(c) <= 0xDFFF]  # not text alone
    for character in characters:
        text = f'a{character}"\\{character}z'
        assert _text(text) == dumps(text), repr(character)
    assert _text("") == '""'
