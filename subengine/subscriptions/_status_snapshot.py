"""The gateway status page's snapshot (docs/status-page.md): what the page shows of
streams, subscriptions, workers, webhooks and dead letters, read in one statement as one
JSON document, so that a gateway process reads it once for all its open pages."""

from __future__ import annotations

from subengine.db._sql import Query, Result

# The newest unresolved dead letters of each subscription a snapshot holds (the page says
# how many there are in all); the rest are for `subengine dead-letters list`.
DEAD_LETTERS_SHOWN = 50
# Error texts are cut at this many characters, so that one long traceback does not make
# every snapshot large.
ERROR_CHARS = 2000


def _document(result: Result) -> str:
    return str(result.rows[0][0])


def status_snapshot(
    dead_letters: int = DEAD_LETTERS_SHOWN, error_chars: int = ERROR_CHARS
) -> Query[str]:
    """The snapshot as JSON text: `taken_at` (the database's clock), `streams`,
    `subscriptions`, `partitions` (the subscription_status view's rows), `workers`,
    `webhooks`, `dead_letters` (the newest unresolved ones of each subscription) and
    `dead_letter_counts` (every unresolved one, by subscription)."""
    return Query(
        "status_page_snapshot",
        {"dead_letters": dead_letters, "error_chars": error_chars},
        _document,
    )
