"""A server process freezes what it holds once its application is built, so that the
collector walks only what requests make (issue 26: a full collection of the startup heap
took 0.4 ms of every append of 500 events)."""

from __future__ import annotations

import gc

import pytest

from subengine.gateway._serve import CONFIG_ENVIRONMENT, app_from_environment


def test_the_served_application_leaves_the_startup_heap_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CONFIG_ENVIRONMENT, "{}")
    monkeypatch.setenv("SUBENGINE_DSN", "postgresql://nobody@127.0.0.1:1/none")
    before = gc.get_freeze_count()
    try:
        app_from_environment()
        assert gc.get_freeze_count() > max(before, 10_000)
    finally:
        gc.unfreeze()
