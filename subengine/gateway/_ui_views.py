"""What the status page shows (docs/status-page.md), made from the snapshots of the
database: each view's content for one visibility (what a key may see and act on),
and what only a run of snapshots tells (events per second, lag over the last minutes,
errors seen since the page opened). Plain data in, plain data out: no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from subengine.model._declarations import Retention
from subengine.model._errors import InvalidInput
from subengine.outside._api_keys import ApiKey

# The views a page can follow: the overview, one subscription, the webhooks, the workers.
OVERVIEW, SUBSCRIPTION, WEBHOOKS, WORKERS = "overview", "subscription", "webhooks", "workers"
VIEWS = (OVERVIEW, SUBSCRIPTION, WEBHOOKS, WORKERS)
# How far back the lag chart and the events per second look, in seconds.
HISTORY_SECONDS = 600.0
RATE_SECONDS = 10.0
# Errors remembered per subscription (the newest first on the page).
RECENT_ERRORS = 20
STATES = ("ok", "idle", "retrying", "stopped", "paused", "gap")


@dataclass(frozen=True)
class Visibility:
    """What a page may see and do: every stream while the gateway is open (`key` None),
    else the streams its key may read or administer; it may act (pause, retry, ...) on
    the subscriptions of streams its key has the `admin` scope on."""

    key: ApiKey | None

    @property
    def cache_key(self) -> object:
        """Pages whose keys see and may do the same share the encoded views."""
        if self.key is None:
            return None
        return (tuple(sorted(self.key.scopes)), tuple(sorted(self.key.streams)))

    def sees(self, stream: str) -> bool:
        key = self.key
        return key is None or key.allows(stream, "read") or key.allows(stream, "admin")

    def acts(self, stream: str) -> bool:
        return self.key is None or self.key.allows(stream, "admin")


def _time(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _seconds(text: str | None) -> Decimal | None:
    try:
        return None if text is None else Decimal(text)
    except InvalidOperation:
        return None


def retention_text(stored: dict[str, Any] | None) -> str:
    """A stored policy as `subengine stream list` prints it."""
    if stored is None:
        return "keep all"
    try:
        return str(Retention.from_json(stored))
    except (InvalidInput, TypeError):
        return str(dict(stored))


def shown_callback(url: str) -> str:
    """A webhook's callback without what may be a secret: user info, query, fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "(not a URL)"
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass
class Board:
    """What a run of snapshots tells beyond the last one: each subscription's lag over
    the last HISTORY_SECONDS, each stream's appends over the last RATE_SECONDS, and the
    errors of each subscription's partitions as they changed."""

    history: dict[str, deque[tuple[float, int, float | None]]] = field(default_factory=dict)
    appended: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    errors: dict[str, deque[dict[str, Any]]] = field(default_factory=dict)
    _last_error: dict[tuple[str, int], tuple[Any, ...]] = field(default_factory=dict)

    def add(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        """Take in a snapshot; the snapshot with `summaries` (per subscription, as
        `subengine status` shows them) and each stream's `events_per_second`."""
        now = _time(snapshot["taken_at"])
        summaries = summarise(snapshot)
        for name, summary in summaries.items():
            seconds = _seconds(summary["lag_seconds"])
            points = self.history.setdefault(name, deque())
            points.append((now, summary["lag"], None if seconds is None else float(seconds)))
            _trim(points, now - HISTORY_SECONDS)
        for gone in set(self.history) - set(summaries):
            del self.history[gone]
        for stream in snapshot["streams"]:
            counts = self.appended.setdefault(stream["name"], deque())
            if stream["appended"] is not None:
                counts.append((now, int(stream["appended"])))
            _trim(counts, now - RATE_SECONDS)
            stream["events_per_second"] = _rate(counts)
        for row in snapshot["partitions"]:
            self._note_error(now, snapshot["taken_at"], row)
        snapshot["summaries"] = summaries
        return snapshot

    def _note_error(self, now: float, taken_at: str, row: dict[str, Any]) -> None:
        where = (row["subscription"], row["partition"])
        if row["last_error"] is None:
            self._last_error.pop(where, None)
            return
        seen = (row["generation"], row["position"], row["attempts"], row["last_error"])
        if self._last_error.get(where) == seen:
            return
        self._last_error[where] = seen
        errors = self.errors.setdefault(row["subscription"], deque(maxlen=RECENT_ERRORS))
        errors.appendleft(
            {
                "seen_at": taken_at,
                "partition": row["partition"],
                "position": row["position"] + 1,
                "state": row["state"],
                "attempts": row["attempts"],
                "error": row["last_error"],
            }
        )


def _trim(points: deque[Any], oldest: float) -> None:
    while points and points[0][0] < oldest:
        points.popleft()


def _rate(counts: deque[tuple[float, int]]) -> float | None:
    if len(counts) < 2 or counts[-1][0] <= counts[0][0]:
        return None
    (first, before), (last, after) = counts[0], counts[-1]
    return round(max(after - before, 0) / (last - first), 1)


def summarise(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per subscription what `subengine status` shows: partitions, lag in events and
    seconds, partitions by state, connected workers running it, generation; with its
    stream, whether it is paused and how many dead letters and parked keys wait."""
    running: dict[str, int] = {}
    for worker in snapshot["workers"]:
        if worker["connected"]:
            for name in set(worker["subscriptions"] or ()):
                running[name] = running.get(name, 0) + 1
    waiting = snapshot["dead_letter_counts"]
    parked = snapshot.get("parked_counts", {})
    summaries: dict[str, dict[str, Any]] = {}
    for stored in snapshot["subscriptions"]:
        name = stored["name"]
        summaries[name] = {
            "subscription": name,
            "stream": stored["stream"],
            "partitions": 0,
            "lag": 0,
            "lag_seconds": None,
            **dict.fromkeys(STATES, 0),
            "workers": running.get(name, 0),
            "generation": stored["generation"],
            "is_paused": stored["paused"],
            "dead_letters": waiting.get(name, 0),
            "parked_keys": parked.get(name, 0),
        }
    for row in snapshot["partitions"]:
        summary = summaries.get(row["subscription"])
        if summary is None:  # stored after the subscriptions were read
            continue
        summary["partitions"] += 1
        summary["lag"] += row["lag"]
        summary[row["state"]] = summary.get(row["state"], 0) + 1
        seconds, most = _seconds(row["lag_seconds"]), _seconds(summary["lag_seconds"])
        if seconds is not None and (most is None or seconds > most):
            summary["lag_seconds"] = row["lag_seconds"]
    return summaries


def overview(snapshot: dict[str, Any], visibility: Visibility) -> dict[str, Any]:
    """Streams and subscriptions at a glance, with how many webhooks, workers and dead
    letters there are to look at."""
    streams = [
        {**stream, "retention": retention_text(stream["retention"])}
        for stream in snapshot["streams"]
        if visibility.sees(stream["name"])
    ]
    subscriptions = [
        {**summary, "may_act": visibility.acts(summary["stream"])}
        for summary in snapshot["summaries"].values()
        if visibility.sees(summary["stream"])
    ]
    return {
        "streams": streams,
        "subscriptions": subscriptions,
        "webhooks": len(webhooks(snapshot, visibility)["webhooks"]),
        "workers": len(workers(snapshot, visibility)["workers"]),
        "dead_letters": sum(s["dead_letters"] for s in subscriptions),
    }


def subscription(
    snapshot: dict[str, Any], board: Board, visibility: Visibility, name: str
) -> dict[str, Any]:
    """One subscription: its partitions, lag over the last minutes, recent errors and
    dead letters; `missing` when there is none this page may see."""
    summary = snapshot["summaries"].get(name)
    if summary is None or not visibility.sees(summary["stream"]):
        return {"name": name, "missing": True}
    points = board.history.get(name, ())
    return {
        "name": name,
        "summary": {**summary, "may_act": visibility.acts(summary["stream"])},
        "partitions": [row for row in snapshot["partitions"] if row["subscription"] == name],
        "dead_letters": [d for d in snapshot["dead_letters"] if d["subscription"] == name],
        "parked": [k for k in snapshot.get("parked", ()) if k["subscription"] == name],
        "errors": list(board.errors.get(name, ())),
        "history": {
            "t": [round(t, 3) for t, _, _ in points],
            "lag": [lag for _, lag, _ in points],
            "lag_seconds": [seconds for _, _, seconds in points],
        },
    }


def webhooks(snapshot: dict[str, Any], visibility: Visibility) -> dict[str, Any]:
    """The webhook subscriptions of streams this page may see, callbacks cut short."""
    return {
        "webhooks": [
            {**hook, "callback": shown_callback(hook["callback"])}
            for hook in snapshot["webhooks"]
            if any(visibility.sees(stream) for stream in hook["streams"] or ())
        ]
    }


def workers(snapshot: dict[str, Any], visibility: Visibility) -> dict[str, Any]:
    """The registered workers; a key that does not see every stream sees the workers of
    the subscriptions it sees, and only those subscriptions of theirs."""
    if visibility.key is None:
        return {"workers": snapshot["workers"]}
    seen = {
        name
        for name, summary in snapshot["summaries"].items()
        if visibility.sees(summary["stream"])
    }
    shown = []
    for worker in snapshot["workers"]:
        names = [name for name in worker["subscriptions"] or () if name in seen]
        if names:
            shown.append({**worker, "subscriptions": names})
    return {"workers": shown}


def view(
    snapshot: dict[str, Any],
    board: Board,
    visibility: Visibility,
    name: str,
    subscription_name: str | None,
) -> dict[str, Any]:
    """The content of view `name` (one of VIEWS) for a page of `visibility`."""
    if name == SUBSCRIPTION:
        return subscription(snapshot, board, visibility, subscription_name or "")
    if name == WEBHOOKS:
        return webhooks(snapshot, visibility)
    if name == WORKERS:
        return workers(snapshot, visibility)
    return overview(snapshot, visibility)
