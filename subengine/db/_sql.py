"""The SQL layer: the only code that executes SQL (DESIGN.md, "Layers").

Every statement the engine runs is a named block in `sql/*.sql`. A concept module (read,
append, subscriptions, ...) never touches a connection to run one: it builds a `Query`,
which names the block, binds its parameters and says how to turn the rows into typed
values and which database errors stand for subengine errors. `SQL`, bound to a schema,
runs a `Query` on a psycopg `Connection` or, with the same text, the same parameters and
the same conversion, on an `AsyncConnection`. So the sync and the async engine share
everything but the connection.

Blocks are rendered once per schema, with the schema quoted by `psycopg.sql.Identifier`;
values are always bound parameters, never formatted into the text. A `-- part:` block is
no statement: it is text that several statements share, placed where they write its name
in braces, as they write `{schema}`.
"""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import pq, sql

T = TypeVar("T")

Row = tuple[Any, ...]

_BLOCK = re.compile(r"^-- (name|part): (\w+)\n", re.MULTILINE)


@functools.cache
def _blocks() -> tuple[dict[str, str], dict[str, str]]:
    """Every named block and every part of every `sql/*.sql` file; a name may appear only
    once."""
    blocks: dict[str, str] = {}
    parts: dict[str, str] = {}
    folder = resources.files("subengine.db").joinpath("sql")
    for file in sorted(folder.iterdir(), key=lambda entry: entry.name):
        if not file.name.endswith(".sql"):
            continue
        pieces = _BLOCK.split(file.read_text("utf-8"))
        for kind, name, body in zip(pieces[1::3], pieces[2::3], pieces[3::3], strict=True):
            if name in blocks or name in parts:
                raise RuntimeError(f"the block {name!r} is named twice in sql/*.sql")
            if name == "schema":
                raise RuntimeError("no block of sql/*.sql may be named 'schema'")
            # the comment under a name documents the block; the server needn't see it
            lines = body.strip().splitlines()
            while lines and lines[0].startswith("--"):
                lines.pop(0)
            (blocks if kind == "name" else parts)[name] = "\n".join(lines)
    return blocks, parts


def names() -> frozenset[str]:
    """The names of every query in `sql/*.sql`."""
    return frozenset(_blocks()[0])


@functools.cache
def _parts(schema: str) -> dict[str, sql.Composed]:
    """Every part, rendered for `schema` once, for the statements that place it."""
    quoted = sql.Identifier(schema)
    rendered = {}
    for part, text in _blocks()[1].items():
        try:
            # its own line's end: a comment on its last line must not swallow what follows
            rendered[part] = sql.SQL(text + "\n").format(schema=quoted)
        except KeyError as error:
            raise RuntimeError(f"the part {part!r} places {error}: a part holds no part") from None
    return rendered


@functools.cache
def _render(schema: str, name: str) -> bytes:
    statement = sql.SQL(_blocks()[0][name])
    return statement.format(schema=sql.Identifier(schema), **_parts(schema)).as_bytes(None)


@dataclass(frozen=True)
class Result:
    """What a statement gave back: its rows (none for a statement without a result) and
    the number of rows it affected."""

    rows: Sequence[Row]
    rowcount: int


def _rows(result: Result) -> Sequence[Row]:
    return result.rows


def first_row(result: Result) -> Row | None:
    """A `Query.read`: the first row, or None when there is none."""
    return result.rows[0] if result.rows else None


def rowcount(result: Result) -> int:
    """A `Query.read`: how many rows the statement affected."""
    return result.rowcount


def nothing(result: Result) -> None:
    """A `Query.read` for a statement whose result says nothing."""


def _translate_nothing(error: psycopg.Error) -> Exception | None:
    return None


@dataclass(frozen=True)
class Query(Generic[T]):
    """One run of a named statement: its name, its parameters, how to read its result
    and which database errors mean something to subengine.

    `read` turns the `Result` into the value the caller gets (default: the rows as
    tuples). `translate` maps a database error to a subengine error, or returns None to
    let the database error through.
    """

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    read: Callable[[Result], T] = _rows  # type: ignore[assignment]
    translate: Callable[[psycopg.Error], Exception | None] = _translate_nothing


def _has_rows(cursor: psycopg.Cursor[Row] | psycopg.AsyncCursor[Row]) -> bool:
    """Whether the statement returned rows (perhaps none), asked of its result:
    `cursor.description` makes an object per column to say it (15 µs for the 18 columns
    of a worker's batch, on every batch)."""
    result = cursor.pgresult
    return result is not None and result.status == pq.ExecStatus.TUPLES_OK


def _result(cursor: psycopg.Cursor[Row] | psycopg.AsyncCursor[Row], rows: list[Row]) -> Result:
    return Result(rows, cursor.rowcount)


class SQL:
    """The named queries bound to one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema

    def __repr__(self) -> str:
        return f"SQL(schema={self.schema!r})"

    def text(self, name: str) -> bytes:
        """The statement `name` for tables in this schema, ready to execute."""
        return _render(self.schema, name)

    def run(self, conn: psycopg.Connection[Any], query: Query[T]) -> T:
        """Run `query` on `conn` (in whatever transaction `conn` is in)."""
        text = self.text(query.name)
        try:
            with conn.cursor() as cursor:
                cursor.execute(text, query.params)
                rows = cursor.fetchall() if _has_rows(cursor) else []
                result = _result(cursor, rows)
        except psycopg.Error as error:
            translated = query.translate(error)
            if translated is None:
                raise
            raise translated from error
        return query.read(result)

    async def run_async(self, conn: psycopg.AsyncConnection[Any], query: Query[T]) -> T:
        """Run `query` on an asyncio connection: the same statement, parameters and
        conversion as `run`."""
        text = self.text(query.name)
        try:
            async with conn.cursor() as cursor:
                await cursor.execute(text, query.params)
                rows = await cursor.fetchall() if _has_rows(cursor) else []
                result = _result(cursor, rows)
        except psycopg.Error as error:
            translated = query.translate(error)
            if translated is None:
                raise
            raise translated from error
        return query.read(result)

    def copy_in(
        self, conn: psycopg.Connection[Any], name: str, rows: Iterable[Sequence[Any]]
    ) -> None:
        """Run the `COPY ... FROM STDIN` statement `name` on `conn`, sending `rows`."""
        with conn.cursor() as cursor, cursor.copy(self.text(name)) as copy:
            for row in rows:
                copy.write_row(row)

    def copy_out(
        self, conn: psycopg.Connection[Any], query: Query[Any], run_bytes: int
    ) -> Generator[CopyRun, None, None]:
        """What the `COPY ... TO STDOUT` statement of `query` sends, as it arrives, in runs
        of whole messages of at least `run_bytes` (the last run may be shorter).

        PostgreSQL sends a message per row. psycopg's Copy object takes each through a
        Python generator, which costs about twice what libpq's own call does, and a bulk
        read's client time is mostly that; so this drives libpq directly. Each message is
        copied into the run's buffer at once, which frees libpq's copy while it is still in
        the cache: keeping a million of them until the end and joining them cost three
        times as much. Parameters are bound on the client, as psycopg binds them for COPY
        (the server takes none there).

        A COPY that fails raises before its last run is given. A caller that stops early
        must close the iterator: that closes the connection, and the server ends the COPY
        when it finds the connection gone.
        """
        text = psycopg.ClientCursor(conn).mogrify(self.text(query.name), query.params)
        pgconn = conn.pgconn
        pgconn.send_query(text.encode(conn.info.encoding))
        result = pgconn.get_result()
        run = CopyRun()
        finished = False
        try:
            if result is not None and result.status == pq.ExecStatus.COPY_OUT:
                receive = pgconn.get_copy_data
                add_data, add_size, received = run.data.extend, run.sizes.append, 0
                while True:
                    size, data = receive(0)  # 0: wait for the next message
                    if size < 0:
                        break
                    add_data(data)
                    add_size(size)
                    received += size
                    if received >= run_bytes:
                        yield run
                        run = CopyRun()
                        add_data, add_size, received = run.data.extend, run.sizes.append, 0
                result = pgconn.get_result()
            error = None
            while result is not None:  # the COPY's outcome, then the end of the results
                if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.COPY_OUT):
                    error = error or psycopg.errors.error_from_result(result, conn.info.encoding)
                result = pgconn.get_result()
            finished = True
            if error is not None:
                raise error
            if run.sizes:
                yield run
        finally:
            if not finished:
                conn.close()


@dataclass(slots=True)
class CopyRun:
    """Consecutive messages of a COPY's data: their bytes back to back, and the size of
    each in bytes."""

    data: bytearray = field(default_factory=bytearray)
    sizes: array[int] = field(default_factory=lambda: array("q"))


class Db:
    """A connection and the schema's queries: what a concept module's multi-statement
    operation runs on (in the caller's transaction)."""

    __slots__ = ("conn", "sql")

    def __init__(self, conn: psycopg.Connection[Any], sql: SQL) -> None:
        self.conn = conn
        self.sql = sql

    def run(self, query: Query[T]) -> T:
        return self.sql.run(self.conn, query)

    @contextmanager
    def transaction(self, force_rollback: bool = False) -> Iterator[psycopg.Transaction]:
        """A transaction (a savepoint inside one) on the connection."""
        with self.conn.transaction(force_rollback=force_rollback) as transaction:
            yield transaction
