"""A fresh database for every test, made and dropped off the test's path.

Cloning the template and dropping a used database each cost a few hundred milliseconds
on a busy server (CREATE DATABASE copies the template after a checkpoint, and DROP
DATABASE waits on the checkpointer), mostly spent waiting, and a test that waited for both
spent that long doing nothing. Here a thread of each pytest process clones the next
database while a test runs, and another drops each used one after its test: a test
takes a database that is ready and hands it back. Every test still gets a database no
other test touched, under a name no other test or session uses.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

# How long a test waits for its database before the suite gives up on the server.
TAKE_TIMEOUT = 120.0
_STOP = ""


class Databases:
    """Databases cloned from `template` on a server, named `prefix` and a number."""

    def __init__(self, *, prefix: str, template: str, **connection: Any) -> None:
        self._admin = make_conninfo(**connection, dbname="postgres")
        self._prefix = prefix
        self._template = template
        self._numbers = itertools.count(1)
        # one clone made ahead: a second would only take CPU from the tests running
        self._ready: queue.Queue[str] = queue.Queue(maxsize=1)
        self._used: queue.Queue[str] = queue.Queue()
        self._failure: BaseException | None = None
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._guarded, args=(self._clone,), daemon=True),
            threading.Thread(target=self._guarded, args=(self._drop,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def take(self) -> str:
        """The name of a fresh database, made for the caller alone."""
        while True:
            if self._failure is not None:
                raise RuntimeError(f"could not prepare a test database: {self._failure}")
            try:
                return self._ready.get(timeout=0.5)
            except queue.Empty:
                continue

    def give_back(self, name: str) -> None:
        """Drop `name` soon, terminating whatever is still connected to it."""
        self._used.put(name)

    def close(self) -> None:
        """Stop making databases and drop every one made, waiting until they are gone."""
        self._stopping.set()
        self._threads[0].join(timeout=TAKE_TIMEOUT)
        while True:
            try:
                self._used.put(self._ready.get_nowait())
            except queue.Empty:
                break
        self._used.put(_STOP)
        self._threads[1].join(timeout=TAKE_TIMEOUT)

    def _guarded(self, work: Any) -> None:
        try:
            with psycopg.connect(self._admin, autocommit=True) as conn:
                work(conn)
        except BaseException as error:  # handed to the test that waits
            self._failure = error

    def _clone(self, conn: psycopg.Connection[Any]) -> None:
        # From PostgreSQL 15, CREATE DATABASE writes every page of the template to the WAL
        # by default. Copying the files instead (after a checkpoint) cost less, a test each:
        # create and drop of the 8 MB template took 12.5 ms of CPU against 22 on the
        # embedded PostgreSQL 16 (in memory), and 80 ms against 105 on PostgreSQL 15 on disk.
        strategy = sql.SQL(" STRATEGY FILE_COPY" if conn.info.server_version >= 150000 else "")
        while not self._stopping.is_set():
            name = f"{self._prefix}_{next(self._numbers)}"
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}{}").format(
                    sql.Identifier(name), sql.Identifier(self._template), strategy
                )
            )
            while True:
                try:
                    self._ready.put(name, timeout=0.5)
                    break
                except queue.Full:
                    if self._stopping.is_set():
                        self._used.put(name)
                        return

    def _drop(self, conn: psycopg.Connection[Any]) -> None:
        while (name := self._used.get()) != _STOP:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
