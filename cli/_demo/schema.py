"""The demo's place: its own schema, claimed and marked, with the stream `orders`, the
projection table and the subscription rebuilding it from the first event."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable

from psycopg import sql

import subengine

from ..demo_app import PROJECTION_DDL, SCHEMA, STREAM, SUBSCRIPTION, projection

PARTITIONS = 8
# The comment on a schema the demo made; a schema of its name without it is not the demo's.
MARKER = "made by `subengine demo`, which writes only into this schema"

Say = Callable[[str], None]


def claim_schema(engine: subengine.Engine, say: Say) -> bool:
    """Create and mark the demo's schema, or make sure the one there is the demo's."""
    with engine.connection() as conn:
        row = conn.execute(
            "SELECT coalesce(obj_description(oid, 'pg_namespace'), '')"
            " FROM pg_namespace WHERE nspname = %s",
            (SCHEMA,),
        ).fetchone()
        if row is None:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
            conn.execute(
                sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
                    sql.Identifier(SCHEMA), sql.Literal(MARKER)
                )
            )
            say(f"created schema {SCHEMA!r}")
            return True
    if row[0] == MARKER:
        return True
    say(
        f"FAILED: schema {SCHEMA!r} exists, and the demo did not make it (it lacks the "
        "demo's comment), so the demo changed nothing. If an older `subengine demo` made "
        f"it (with only a table {STREAM}), drop it and run the demo again: "
        f"psql \"$({command_name()} db url)\" -c 'DROP SCHEMA {SCHEMA} CASCADE'"
    )
    return False


def prepare(engine: subengine.Engine, say: Say) -> bool:
    """Stream, projection table and subscription, the subscription rebuilding from the
    beginning: its reset and the projection's truncation commit together."""
    existing = {s.name: s for s in engine.streams()}
    if STREAM not in existing:
        engine.create_stream(STREAM, PARTITIONS)
        say(f"created stream {STREAM!r} with {PARTITIONS} partitions")
    elif existing[STREAM].partitions != PARTITIONS:
        say(
            f"FAILED: stream {STREAM!r} of schema {SCHEMA!r} already exists with "
            f"{existing[STREAM].partitions} partitions, not {PARTITIONS}, so the demo changed "
            f"nothing; drop the schema and run the demo again: psql "
            f"\"$({command_name()} db url)\" -c 'DROP SCHEMA {SCHEMA} CASCADE'"
        )
        return False
    else:
        say(f"stream {STREAM!r} exists: the projection is rebuilt from its first event")
    engine.ensure_subscription(projection)
    engine.resume_subscription(SUBSCRIPTION)
    with engine.connection() as conn:
        conn.execute(PROJECTION_DDL)
        subengine.reset_subscription(conn, SUBSCRIPTION, "beginning", settings=engine.settings)
        conn.execute("TRUNCATE subengine_demo.orders")
    say(f"subscription {SUBSCRIPTION!r} projects orders into table subengine_demo.orders")
    return True


def command_name() -> str:
    """How the reader can call `subengine` again: by name if it is on PATH."""
    program = sys.argv[0]
    on_path = shutil.which("subengine")
    if os.sep not in program or (on_path and os.path.samefile(on_path, program)):
        return "subengine"
    relative = os.path.relpath(program)
    return program if relative.startswith("..") else relative
