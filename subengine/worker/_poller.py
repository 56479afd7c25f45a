"""The poller: one per worker process, on a connection of its own. It turns notifications
into suspects on the board and wake-ups for the slots, and once per poll interval
compares the heads it knows with the database's and asks whether any partition has work
(its only statement when the worker is idle, and the heartbeat too)."""

from __future__ import annotations

import json
import logging
import threading
import time

import psycopg

from subengine.db._sql import Db
from subengine.subscriptions._failures import error_text
from subengine.subscriptions._work import (
    listen_for_appends,
    poll_for_work,
    prepare_worker_connection,
    stream_heads,
)
from subengine.worker._state import POLLER_SESSION, RECONNECT_DELAY_SECONDS, WorkerState

log = logging.getLogger("subengine.worker")

# How often the poller, between notifications, checks whether the worker is stopping.
_LISTEN_CHECK_SECONDS = 0.25


class Poller:
    """The poller of one worker (see `run`)."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._board = state.board
        self._wakeup = state.wakeup
        self._metrics = state.metrics

    def run(self, stop: threading.Event) -> None:
        """The worker's poller, on a connection of its own: it turns notifications into
        suspects and wake-ups, and polls once per poll interval (which is also the
        heartbeat when one is due). On every (re)connection it reads the heads and makes
        every partition a suspect: anything may have come meanwhile. Whatever goes wrong
        is logged and counted, and it connects again: push only saves time, so it must
        never stop for good; a database unreachable for the outage timeout ends the
        worker (its slots, idle, would not notice)."""
        outage_since: float | None = None
        while not stop.is_set():
            try:
                with self._state.connect_own(POLLER_SESSION) as conn:
                    db = Db(conn, self._state.engine.sql)
                    if self._state.sessions:
                        prepare_worker_connection(db)
                    # every partition is a suspect for the first look, which comes after
                    # the LISTEN: nothing appended before or after it goes unseen
                    self._board.heads_read(stream_heads(db, self._board.streams), everything=True)
                    if self._state.listen:
                        listen_for_appends(db)
                    outage_since = None
                    self._wakeup.notify()
                    self._polling(db, stop)
            except Exception as error:
                if isinstance(error, psycopg.OperationalError):
                    outage_since = outage_since or time.monotonic()
                    if self._state.gave_up(outage_since, error, stop):
                        return
                self._metrics.listener_failed()
                log.warning(
                    "the poller's connection failed (%s); reconnecting in %g s",
                    error_text(error),
                    RECONNECT_DELAY_SECONDS,
                    exc_info=not isinstance(error, psycopg.OperationalError),
                    extra=self._state.fields(error=error_text(error)),
                )
                stop.wait(RECONNECT_DELAY_SECONDS)

    def _polling(self, db: Db, stop: threading.Event) -> None:
        settings = self._state.settings
        next_poll = time.monotonic() + settings.poll_interval
        next_beat = time.monotonic() + settings.heartbeat_interval
        while not stop.is_set():
            now = time.monotonic()
            if now >= min(next_poll, next_beat):
                beat = now >= next_beat
                self._poll_once(db, beat)
                next_poll = now + settings.poll_interval
                if beat:
                    next_beat = now + settings.heartbeat_interval
                continue
            wait = min(min(next_poll, next_beat) - now, _LISTEN_CHECK_SECONDS)
            if not self._state.listen:
                stop.wait(wait)
                continue
            for notification in db.conn.notifies(timeout=wait):
                grown = self._grown(notification.payload)
                if grown is not None and self._board.grew(*grown):
                    self._metrics.notification_received()
                    self._metrics.woke(by_notification=True)
                    # for the slots that take its suspects: no other needs to look
                    self._wakeup.notify(look=False)

    def _poll_once(self, db: Db, beat: bool) -> None:
        """One poll: the heads' sums and whether any partition has work (and the
        heartbeat with `beat`); the slots are woken if something may be waiting."""
        totals, has_work = poll_for_work(
            db,
            self._state.registration(),
            self._state.serving(),
            self._board.streams,
            beat and not self._state.stopping,  # never register again once stopping
        )
        self._metrics.woke(by_notification=False)
        differs = self._board.differs(totals)
        grown = differs and self._board.heads_read(stream_heads(db, differs), everything=False)
        if self._board.retry_deferred() or has_work or grown or self._board.pending():
            self._wakeup.notify()

    @staticmethod
    def _grown(payload: str) -> tuple[str, int, int] | None:
        """The (stream, partition, head) a notification names; None (after a warning)
        for a payload that does not parse: then only the polls see that append."""
        try:
            notice = json.loads(payload)
            return str(notice["stream"]), int(notice["partition"]), int(notice["head"])
        except (ValueError, TypeError, KeyError, RecursionError) as error:
            log.warning("a notification that does not parse (%s): %r", error, payload[:200])
            return None
