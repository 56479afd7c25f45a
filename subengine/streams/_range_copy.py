"""Copying a range of one partition's events out in PostgreSQL's binary COPY format, for a
bulk reader that decodes the columns itself (the Spark data source: `spark/_binary_copy`).
"""

from __future__ import annotations

from collections.abc import Generator
from datetime import datetime

from subengine.db._sql import CopyRun, Db, Query, nothing
from subengine.model._names import EARLIEST, LATEST


def copy_range(
    db: Db,
    stream: str,
    partition: int,
    after: int,
    upto: int,
    since: datetime | None,
    until: datetime | None,
    run_bytes: int,
) -> Generator[CopyRun, None, None]:
    """The events of positions (after, upto] of one partition recorded in [since, until),
    in position order, as the binary COPY data of spark_read_range's columns, in runs of
    at least `run_bytes` (see `SQL.copy_out`, which says how to stop early).

    First sets the plan of the rest of the connection's transaction for reading a range;
    the COPY starts when the first run is asked for.
    """
    db.run(Query("spark_read_plan", {}, nothing))
    params = {
        "stream": stream,
        "partition": partition,
        "after": after,
        "upto": upto,
        "since": since or EARLIEST,
        "until": until or LATEST,
    }
    return db.sql.copy_out(db.conn, Query("spark_read_range", params), run_bytes)
