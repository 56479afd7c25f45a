"""What both engines run with: their settings and the DSN they connect to, the embedded
PostgreSQL's when none is given."""

from __future__ import annotations

import logging

from subengine.db import _embedded
from subengine.db._connection import dsn_problem
from subengine.model._errors import ConfigurationError
from subengine.model._settings import Settings

log = logging.getLogger("subengine")

_announced_homes: set[str] = set()


def configured(
    dsn: str | None, schema: str | None, settings: Settings | None
) -> tuple[Settings, str]:
    """The settings an engine runs with and the DSN it connects to: the given DSN once it
    parses, or the embedded PostgreSQL's, which it starts (or finds) and announces once per
    data directory and process."""
    base = settings or Settings.from_env()
    changes = {k: v for k, v in {"dsn": dsn, "schema": schema}.items() if v is not None}
    settings = base.with_changes(**changes) if changes else base
    if settings.direct_dsn is not None:
        problem = dsn_problem(settings.direct_dsn)
        if problem is not None:
            raise ConfigurationError(f"invalid direct DSN (SUBENGINE_DIRECT_DSN): {problem}")
    if settings.dsn is not None:
        problem = dsn_problem(settings.dsn)
        if problem is not None:
            raise ConfigurationError(f"invalid DSN: {problem}")
        return settings, settings.dsn
    url = _embedded.embedded_url(settings.home)
    # A warning, so that it reaches stderr even where logging is not configured: a
    # production deployment that forgot SUBENGINE_DSN should notice.
    home = str(settings.home.expanduser().resolve())
    if home not in _announced_homes:
        _announced_homes.add(home)
        log.warning(
            "subengine: no SUBENGINE_DSN or dsn given; using the embedded PostgreSQL in %s "
            "(stop it with `subengine db stop`)",
            home,
        )
    return settings, url
