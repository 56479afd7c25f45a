"""The PySpark data source `subengine`: batch and streaming reads, writes, exactly once.

How the tests reach a database: Spark's Python workers inherit the environment of the
JVM, which is fixed when the SparkSession starts, so the per-test databases of conftest.py
cannot reach them. These tests instead create one database of their own, once, on the same
server (`subengine_spark_tests_<tag>`, tagged like conftest's, dropped afterwards), put its
DSN in the variable SUBENGINE_SPARK_TEST_DSN before the session starts, and pass that name
as the `dsnEnv` option. Every test uses streams of its own, with unique names. The one SparkSession,
local[2] with up to 2 attempts per task, is shared by every test of the session.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from helpers import JIT_LIGHT, ROOT, SESSION_TAG, spark_worker_python
from psycopg.conninfo import make_conninfo
from psycopg.sql import SQL, Identifier
from pytest_postgresql.executors import NoopExecutor

import subengine
from subengine import NewEvent
from subengine.db import _migrate
from subengine.model._logging import extra_fields

pyspark = pytest.importorskip(
    "pyspark", reason="PySpark is not installed: pip install -e '.[spark]'"
)
# one SparkSession (a JVM) for the whole module: under xdist its tests share one worker
pytestmark = pytest.mark.xdist_group("spark")

if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17 or later: none found", allow_module_level=True)

from pyspark import TaskContext  # noqa: E402
from pyspark.cloudpickle import register_pickle_by_value  # noqa: E402
from pyspark.errors import PySparkException, StreamingQueryException  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.datasource import (  # noqa: E402
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.query import StreamingQuery  # noqa: E402
from pyspark.sql.types import StructType  # noqa: E402

import subengine.spark  # noqa: E402
from subengine.spark._source import (  # noqa: E402
    EVENT_SCHEMA,
    BatchReader,
    BatchWriter,
    EventRange,
    StreamReader,
    StreamWriter,
    SubengineDataSource,
    WriteCommit,
)

DSN_ENV = "SUBENGINE_SPARK_TEST_DSN"
LOCAL_DIR_ENV = "SUBENGINE_SPARK_TEST_LOCAL_DIR"
DATABASE = f"subengine_spark_tests_{SESSION_TAG}"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# The injected-failure data sources below are pickled by value: Spark's Python workers
# cannot import this test module.
register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]


@pytest.fixture(scope="session")
def spark_dsn(postgresql_migrated_server: NoopExecutor) -> Iterator[str]:
    server = postgresql_migrated_server
    params: dict[str, Any] = dict(
        host=server.host, port=server.port, user=server.user, password=server.password or ""
    )
    maintenance = make_conninfo(**params, dbname="postgres")
    drop = SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(Identifier(DATABASE))
    with psycopg.connect(maintenance, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(SQL("CREATE DATABASE {}").format(Identifier(DATABASE)))
    dsn = make_conninfo(**params, dbname=DATABASE)
    _migrate.upgrade(dsn, "subengine", subengine.Settings().connect_timeout)
    yield dsn
    with psycopg.connect(maintenance, autocommit=True) as conn:
        conn.execute(drop)


@pytest.fixture(scope="session")
def spark(spark_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    os.environ["PYSPARK_PYTHON"] = spark_worker_python(tmp_path_factory.mktemp("spark-python"))
    os.environ[DSN_ENV] = spark_dsn
    # Shuffle files go to a directory of this session's own, which LosingShuffleWrites
    # empties to make Spark recompute a shuffle.
    local_dir = tmp_path_factory.mktemp("spark-local")
    os.environ[LOCAL_DIR_ENV] = str(local_dir)
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("subengine-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.local.dir", str(local_dir))
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.stopTimeout", "30s")
        .config("spark.driver.extraJavaOptions", JIT_LIGHT)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    subengine.spark.register(session)
    session.dataSource.register(FlakyWrites)
    session.dataSource.register(EarlyFlakyWrites)
    session.dataSource.register(ShiftingRows)
    session.dataSource.register(LosingShuffleWrites)
    session.dataSource.register(ForgetfulWrites)
    session.dataSource.register(PrunedWhileReading)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def db(spark_dsn: str) -> Iterator[subengine.Engine]:
    with subengine.Engine(spark_dsn) as engine:
        yield engine


@pytest.fixture
def sql(spark_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(spark_dsn, autocommit=True) as conn:
        yield conn


_names = itertools.count()


@pytest.fixture
def new_stream(db: subengine.Engine) -> Callable[..., str]:
    """Makes a stream with a name no other test uses."""

    def make(partitions: int = 3) -> str:
        name = f"spark-{next(_names)}-{uuid.uuid4().hex[:8]}"
        db.create_stream(name, partitions)
        return name

    return make


def read(spark: SparkSession, stream: str, source: str = "subengine", **options: str) -> DataFrame:
    reader = spark.read.format(source).option("stream", stream).option("dsnEnv", DSN_ENV)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def read_stream(
    spark: SparkSession, stream: str, source: str = "subengine", **options: str
) -> DataFrame:
    reader = spark.readStream.format(source).option("stream", stream).option("dsnEnv", DSN_ENV)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def micros(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def orders(count: int, prefix: str = "order") -> list[NewEvent]:
    """Events over many keys with awkward JSON: quotes, commas, line breaks, unicode."""
    return [
        NewEvent(
            f"{prefix}-{n % 17}",
            "OrderPlaced" if n % 3 else 'Order, "quoted"',
            {"n": n, "total": n * 1.5, "note": 'a "b", c\nd ✓', "items": [{"sku": f"s{n}"}]},
            metadata={"source": "test", "n": n},
            occurred_at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=7 * n),
        )
        for n in range(count)
    ]


def sql_rows(sql: psycopg.Connection[Any], stream: str) -> list[tuple[Any, ...]]:
    rows = sql.execute(
        "SELECT stream, partition, position, id::text, key, key_version, type, data::text,"
        " metadata::text, occurred_at, recorded_at FROM subengine.events WHERE stream = %s"
        " ORDER BY partition, position",
        (stream,),
    ).fetchall()
    return [(*row[:9], micros(row[9]), micros(row[10])) for row in rows]


def spark_rows(frame: DataFrame) -> list[tuple[Any, ...]]:
    columns = [c for c in frame.columns if c not in ("occurred_at", "recorded_at")]
    selected = frame.select(
        *columns, F.unix_micros("occurred_at").alias("o"), F.unix_micros("recorded_at").alias("r")
    )
    return sorted(tuple(row) for row in selected.collect())


def no_jobs_ran(spark: SparkSession, group: str) -> bool:
    return list(spark.sparkContext.statusTracker().getJobIdsForGroup(group)) == []


class Collector:
    """A foreachBatch sink that keeps every row it is given, with its micro-batch id.

    `fail_on` makes the first call for that micro-batch raise after the rows are kept,
    as a query that dies before Spark records the batch as done."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[tuple[int, list[tuple[Any, ...]]]] = []
        self.fail_on = fail_on

    def __call__(self, frame: DataFrame, batch_id: int) -> None:
        rows = [(r.partition, r.position, r.id) for r in frame.collect()]
        self.calls.append((batch_id, rows))
        if batch_id == self.fail_on:
            self.fail_on = None
            raise RuntimeError(f"injected failure in micro-batch {batch_id}")

    def delivered(self) -> list[tuple[Any, ...]]:
        """The rows of every micro-batch, the last delivery of each batch id only."""
        last = dict(self.calls)
        return [row for batch_id in sorted(last) for row in last[batch_id]]


def run_available_now(
    frame: DataFrame, sink: Callable[[DataFrame, int], None], checkpoint: Path
) -> StreamingQuery:
    query = (
        frame.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query


def stored_events(sql: psycopg.Connection[Any], stream: str) -> list[tuple[Any, ...]]:
    """(partition, position, id) of every stored event of the stream."""
    return [row[1:4] for row in sql_rows(sql, stream)]


def start_live(
    frame: DataFrame, sink: Callable[[DataFrame, int], None], checkpoint: Path
) -> StreamingQuery:
    """A query that looks for new events every 200 ms until it is stopped."""
    return (
        frame.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="200 milliseconds")
        .start()
    )


def assert_each_event_once_in_order(
    sql: psycopg.Connection[Any], stream: str, rows: list[tuple[Any, ...]]
) -> None:
    stored = set(stored_events(sql, stream))
    assert sorted(rows) == sorted(stored)
    assert len(rows) == len(set(rows))
    for partition in {p for p, _, _ in rows}:
        positions = [pos for p, pos, _ in rows if p == partition]
        assert positions == sorted(positions)


# batch reads


def test_the_python_workers_import_the_pyspark_of_this_environment(spark: SparkSession) -> None:
    # the one the driver imported, whose bytecode is written, not Spark's pyspark.zip
    # (helpers.spark_worker_python)
    def origin(_: int) -> str:
        import pyspark

        return str(pyspark.__file__)

    assert spark.sparkContext.parallelize([0], 1).map(origin).collect() == [pyspark.__file__]


def test_batch_read_equals_the_sql_read_of_the_stream(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=3)
    db.append(stream, orders(400))
    frame = read(spark, stream, rowsPerSplit="60")
    heads = db.heads(stream)
    assert frame.rdd.getNumPartitions() == sum(-(-h // 60) for h in heads.values())
    assert spark_rows(frame) == sql_rows(sql, stream)


def test_batch_read_takes_chosen_partitions_and_a_time_window(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=3)
    db.append(stream, orders(60))
    middle = sql.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    db.append(stream, orders(60, prefix="late"))
    end = sql.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    db.append(stream, orders(10, prefix="last"))
    frame = read(spark, stream, partitions="0,2", since=middle.isoformat(), until=end.isoformat())
    expected = [
        row
        for row in sql_rows(sql, stream)
        if row[1] in (0, 2) and micros(middle) <= row[10] < micros(end)
    ]
    assert {row[4].split("-")[0] for row in expected} == {"late"}
    assert spark_rows(frame) == expected


# streaming reads


def test_appends_between_micro_batches_arrive_once_in_position_order(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=3)
    db.append(stream, orders(50))
    sink = Collector()
    query = start_live(read_stream(spark, stream), sink, tmp_path / "checkpoint")
    try:
        query.processAllAvailable()
        for round_ in range(3):
            db.append(stream, orders(20, prefix=f"round{round_}"))
            query.processAllAvailable()
    finally:
        query.stop()
    assert len([batch for batch, rows in sink.calls if rows]) >= 4
    assert [batch for batch, _ in sink.calls] == sorted({batch for batch, _ in sink.calls})
    assert_each_event_once_in_order(sql, stream, sink.delivered())


def test_restart_after_a_failed_micro_batch_replays_it_exactly(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=3)
    checkpoint = tmp_path / "checkpoint"
    db.append(stream, orders(30))
    first = Collector()
    run_available_now(read_stream(spark, stream), first, checkpoint)
    assert len(first.delivered()) == 30

    db.append(stream, orders(20, prefix="second"))
    failing = Collector(fail_on=1)
    with pytest.raises(StreamingQueryException, match="injected failure in micro-batch 1"):
        run_available_now(read_stream(spark, stream), failing, checkpoint)
    [(batch_id, failed_rows)] = failing.calls
    assert (batch_id, len(failed_rows)) == (1, 20)

    db.append(stream, orders(10, prefix="third"))
    resumed = Collector()
    run_available_now(read_stream(spark, stream), resumed, checkpoint)
    # Batch 1 again, with the very rows of the failed attempt, then the newer events.
    assert resumed.calls[0] == (1, failed_rows)
    rows = first.delivered() + resumed.delivered()
    assert len(rows) == 60
    assert_each_event_once_in_order(sql, stream, rows)


def test_max_records_per_trigger_bounds_every_micro_batch(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=3)
    db.append(stream, orders(100))
    sink = Collector()
    frame = read_stream(spark, stream, maxRecordsPerTrigger="15")
    run_available_now(frame, sink, tmp_path / "checkpoint")
    sizes = [len(rows) for _, rows in sink.calls if rows]
    assert sizes == [15] * 6 + [10]
    assert_each_event_once_in_order(sql, stream, sink.delivered())


def test_available_now_stops_at_the_heads_it_found_when_the_query_started(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=3)
    before = db.append(stream, orders(30))
    checkpoint = tmp_path / "checkpoint"

    class AppendingSink(Collector):
        def __call__(self, frame: DataFrame, batch_id: int) -> None:
            super().__call__(frame, batch_id)
            if batch_id == 0:
                db.append(stream, orders(5, prefix="during"))

    sink = AppendingSink()
    run_available_now(read_stream(spark, stream, maxRecordsPerTrigger="10"), sink, checkpoint)
    assert sorted(sink.delivered()) == sorted((a.partition, a.position, str(a.id)) for a in before)
    later = Collector()
    run_available_now(read_stream(spark, stream), later, checkpoint)
    assert len(later.delivered()) == 5
    assert_each_event_once_in_order(sql, stream, sink.delivered() + later.delivered())


def test_latest_starts_after_the_heads_at_the_first_micro_batch(
    spark: SparkSession, db: subengine.Engine, new_stream: Callable[..., str], tmp_path: Path
) -> None:
    stream = new_stream(partitions=3)
    db.append(stream, orders(25))
    sink = Collector()
    frame = read_stream(spark, stream, startingPositions="latest")
    query = start_live(frame, sink, tmp_path / "checkpoint")
    try:
        query.processAllAvailable()
        new = db.append(stream, orders(5, prefix="new"))
        query.processAllAvailable()
    finally:
        query.stop()
    assert sorted(sink.delivered()) == sorted((a.partition, a.position, str(a.id)) for a in new)


def test_a_subscription_gives_the_start_and_follows_the_commits(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=3)
    db.append(stream, orders(40))
    name = f"{stream}-spark"
    db.ensure_subscription(subengine.Subscription(name, stream))
    start = {0: 2, 1: 0, 2: 5}
    db.reset_subscription(name, start)
    heads = db.heads(stream)
    sink = Collector()
    checkpoint = tmp_path / "checkpoint"
    options = {"startingPositions": f"subscription:{name}", "subscription": name}
    run_available_now(
        read_stream(spark, stream, maxRecordsPerTrigger="10", **options), sink, checkpoint
    )
    rows = sink.delivered()
    assert sorted(rows) == sorted(
        (p, pos, i) for p, pos, i in stored_events(sql, stream) if pos > start[p]
    )
    # Spark confirms a micro-batch when it plans the next one: the positions trail by one.
    moved = {p.partition: p.position for p in db.subscription_positions(name)}
    assert sum(moved.values()) == sum(start.values()) + len(rows) - len(sink.calls[-1][1])

    db.append(stream, orders(3, prefix="more"))
    run_available_now(read_stream(spark, stream, **options), Collector(), checkpoint)
    moved = {p.partition: p.position for p in db.subscription_positions(name)}
    assert all(moved[p] >= heads[p] for p in heads)


# retention gaps


def prune(conn: psycopg.Connection[Any], stream: str, partition: int, floor: int) -> None:
    """Remove the partition's positions below `floor` and raise its floor to it, in one
    transaction, as retention does."""
    with conn.transaction():
        conn.execute(
            "DELETE FROM subengine.events WHERE stream = %s AND partition = %s AND position < %s",
            (stream, partition, floor),
        )
        conn.execute(
            "UPDATE subengine.partitions SET floor = %s"
            " WHERE stream = %s AND partition = %s AND floor < %s",
            (floor, stream, partition, floor),
        )


def prune_on_read(sql: psycopg.Connection[Any], stream: str, partition: int, floor: int) -> None:
    """Make the read tasks of PrunedWhileReading prune the partition up to `floor`."""
    sql.execute("CREATE TABLE IF NOT EXISTS prune_on_read (stream text, partition int, floor int)")
    sql.execute("INSERT INTO prune_on_read VALUES (%s, %s, %s)", (stream, partition, floor))


class PrunedWhileReading(SubengineDataSource):
    """The subengine source, whose read tasks first prune the partitions that the table
    `prune_on_read` names: retention running after Spark planned the read, before its
    tasks read."""

    @classmethod
    def name(cls) -> str:
        return "subengine_pruned_while_reading"

    def reader(self, schema: StructType) -> DataSourceReader:
        reader = super().reader(schema)
        assert isinstance(reader, BatchReader)
        return PruningBatchReader(reader.options)

    def streamReader(self, schema: StructType) -> StreamReader:
        reader = super().streamReader(schema)
        assert isinstance(reader, StreamReader)
        return PruningStreamReader(reader.options)


def prune_as_asked(stream: str) -> None:
    with psycopg.connect(os.environ[DSN_ENV], autocommit=True) as conn:
        asked = conn.execute(
            "SELECT partition, floor FROM prune_on_read WHERE stream = %s", (stream,)
        ).fetchall()
        for partition, floor in asked:
            prune(conn, stream, partition, floor)


class PruningBatchReader(BatchReader):
    def read(self, partition: InputPartition) -> Iterator[Any]:
        prune_as_asked(self.options.target.stream)
        return super().read(partition)


class PruningStreamReader(StreamReader):
    def read(self, partition: InputPartition) -> Iterator[Any]:
        prune_as_asked(self.target.stream)
        return super().read(partition)


def test_a_micro_batch_that_needs_removed_positions_fails_naming_them(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=1)
    db.append(stream, orders(10))
    prune(sql, stream, 0, 4)
    # One event per micro-batch; the first still meets the whole gap.
    frame = read_stream(spark, stream, startingPositions='{"0": 1}', maxRecordsPerTrigger="1")
    message = (
        f"retention removed positions 2 to 3 of partition 0 of stream '{stream}', which this "
        "read needs (the partition keeps positions from 4 on). To skip them and read on from "
        "position 4, set the option failOnDataLoss to false"
    )
    sink = Collector()
    with pytest.raises(StreamingQueryException, match=re.escape(message)):
        run_available_now(frame, sink, tmp_path / "checkpoint")
    assert sink.delivered() == []


def test_a_query_stopped_by_a_gap_goes_on_from_the_floor_with_fail_on_data_loss_false(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=2)
    checkpoint = tmp_path / "checkpoint"
    db.append(stream, orders(20))
    first = Collector()
    run_available_now(read_stream(spark, stream), first, checkpoint)
    db.append(stream, orders(40, prefix="later"))
    read_up_to = max(pos for p, pos, _ in first.delivered() if p == 0)
    prune(sql, stream, 0, read_up_to + 6)
    with pytest.raises(StreamingQueryException, match="set the option failOnDataLoss to false"):
        run_available_now(read_stream(spark, stream), Collector(), checkpoint)

    resumed = Collector()
    frame = read_stream(spark, stream, failOnDataLoss="FALSE", maxRecordsPerTrigger="7")
    run_available_now(frame, resumed, checkpoint)
    stored = {row for row in stored_events(sql, stream) if row not in first.delivered()}
    assert sorted(resumed.delivered()) == sorted(stored)
    for partition in (0, 1):
        positions = [pos for p, pos, _ in resumed.delivered() if p == partition]
        assert positions == sorted(positions)
    assert min(pos for p, pos, _ in resumed.delivered() if p == 0) == read_up_to + 6


def test_a_micro_batch_skips_positions_removed_after_planning_with_fail_on_data_loss_false(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    stream = new_stream(partitions=1)
    db.append(stream, orders(10))
    prune_on_read(sql, stream, 0, 4)
    frame = read_stream(
        spark, stream, source="subengine_pruned_while_reading", failOnDataLoss="false"
    )
    sink = Collector()
    run_available_now(frame, sink, tmp_path / "checkpoint")
    assert [pos for _, pos, _ in sink.delivered()] == list(range(4, 11))


def test_a_batch_read_fails_when_retention_removes_its_positions_after_planning(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=1)
    db.append(stream, orders(10))
    prune(sql, stream, 0, 4)
    assert [row.position for row in read(spark, stream).collect()] == list(range(4, 11))
    prune_on_read(sql, stream, 0, 7)
    frame = read(spark, stream, source="subengine_pruned_while_reading")
    with pytest.raises(PySparkException, match="retention removed positions 4 to 6 of partition"):
        frame.collect()


def test_a_batch_read_skips_positions_removed_after_planning_with_fail_on_data_loss_false(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=2)
    db.append(stream, orders(30))
    prune_on_read(sql, stream, 1, 5)
    frame = read(spark, stream, source="subengine_pruned_while_reading", failOnDataLoss="false")
    rows = spark_rows(frame)
    assert rows == sql_rows(sql, stream)
    assert min(row[2] for row in rows if row[1] == 1) == 5


def test_a_skipped_gap_is_logged_naming_stream_partition_and_positions(
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    spark_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The readers' methods run here, not in Spark's Python workers, whose logs go elsewhere.
    monkeypatch.setenv(DSN_ENV, spark_dsn)
    stream = new_stream(partitions=1)
    db.append(stream, orders(10))
    options = {"stream": stream, "dsnEnv": DSN_ENV, "failOnDataLoss": "false"}
    source = SubengineDataSource(options)
    planned = source.streamReader(EVENT_SCHEMA).partitions({"0": 0}, {"0": 10})
    prune(sql, stream, 0, 4)
    rows = list(source.reader(EVENT_SCHEMA).read(EventRange(0, 0, 10)))
    assert sum(batch.num_rows for batch in rows) == 7
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="subengine.spark"):
        ranges = source.streamReader(EVENT_SCHEMA).partitions({"0": 1}, {"0": 10})
        list(source.reader(EVENT_SCHEMA).read(EventRange(0, 0, 10)))
    assert planned == [EventRange(0, 0, 10)]
    assert ranges == [EventRange(0, 3, 10)]
    skipped = (
        f"skipped positions 2 to 3 of partition 0 of stream {stream}: retention removed them",
        f"skipped positions 1 to 3 of partition 0 of stream {stream}: retention removed them",
    )
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == list(skipped)
    assert [extra_fields(r) for r in caplog.records] == [
        {"stream": stream, "partition": 0, "from_position": f, "to_position": 3, "floor": 4}
        for f in (2, 1)
    ]


# writes


class FlakyWrites(SubengineDataSource):
    """The subengine source, whose writers fail once after their work is done: a batch
    write's task 0 on its first attempt, after it staged its rows; a streaming write's
    driver-side commit of micro-batch 0, after it appended the micro-batch. Each failure is
    recorded in the table `injected_failures`."""

    @classmethod
    def name(cls) -> str:
        return "subengine_flaky"

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        writer = super().writer(schema, overwrite)
        return FlakyBatchWriter(writer.target, writer.partitions, writer.write_id)

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamWriter:
        writer = super().streamWriter(schema, overwrite)
        return FlakyStreamWriter(writer.target, writer.partitions)


def record_failure(target: Any, what: str) -> None:
    with psycopg.connect(os.environ[target.dsn_env], autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS injected_failures (stream text, what text)")
        done = conn.execute(
            "SELECT 1 FROM injected_failures WHERE stream = %s AND what = %s", (target.stream, what)
        ).fetchone()
        if done is None:
            conn.execute("INSERT INTO injected_failures VALUES (%s, %s)", (target.stream, what))
            raise RuntimeError(f"injected failure: {what}")


class FlakyBatchWriter(subengine.spark._source.BatchWriter):
    def write(self, iterator: Iterator[Any]) -> WriteCommit:
        message = super().write(iterator)
        context = TaskContext.get()
        if context.partitionId() == 0 and context.attemptNumber() == 0:  # type: ignore[union-attr]
            record_failure(self.target, "task 0 after it staged its rows")
        return message


class FlakyStreamWriter(StreamWriter):
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        super().commit(messages, batchId)
        if batchId == 0:
            record_failure(self.target, "micro-batch 0 after its commit")


class EarlyFlakyWrites(SubengineDataSource):
    """The subengine source, whose streaming writes fail once in the driver-side commit of
    micro-batch 0, before it appends anything (after the tasks staged their rows)."""

    @classmethod
    def name(cls) -> str:
        return "subengine_flaky_early"

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamWriter:
        writer = super().streamWriter(schema, overwrite)
        return EarlyFlakyStreamWriter(writer.target, writer.partitions)


class EarlyFlakyStreamWriter(StreamWriter):
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if batchId == 0:
            record_failure(self.target, "micro-batch 0 before its commit")
        super().commit(messages, batchId)


def injected(sql: psycopg.Connection[Any], stream: str) -> list[str]:
    return [
        r[0] for r in sql.execute("SELECT what FROM injected_failures WHERE stream = %s", (stream,))
    ]


def test_a_retried_write_task_stores_each_row_once(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=3)
    rows = [(f"k{n % 7}", "Computed", json.dumps({"n": n})) for n in range(200)]
    rows += [("same", "Twin", '{"x": 1}')] * 3  # identical rows are all stored
    frame = spark.createDataFrame(rows, "key string, type string, data string").repartition(2)
    frame.write.format("subengine_flaky").option("stream", stream).option("dsnEnv", DSN_ENV).mode(
        "append"
    ).save()
    assert injected(sql, stream) == ["task 0 after it staged its rows"]
    stored = sql.execute(
        "SELECT key, type, data::text FROM subengine.events WHERE stream = %s", (stream,)
    ).fetchall()
    assert sorted(stored) == sorted((k, t, json.dumps(json.loads(d))) for k, t, d in rows)


@pytest.mark.parametrize(
    ("source_name", "stored_by_the_failed_run"),
    [("subengine_flaky", 40), ("subengine_flaky_early", 0)],
    ids=["after-its-commit", "before-its-commit"],
)
def test_a_replayed_micro_batch_of_a_streaming_write_stores_each_row_once(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
    source_name: str,
    stored_by_the_failed_run: int,
) -> None:
    source, target = new_stream(partitions=3), new_stream(partitions=2)
    db.append(source, orders(40))
    checkpoint = tmp_path / "checkpoint"

    def run() -> str:
        derived = read_stream(spark, source).select(
            "key", F.lit("Seen").alias("type"), F.to_json(F.struct("position", "id")).alias("data")
        )
        query = (
            derived.writeStream.format(source_name)
            .option("stream", target)
            .option("dsnEnv", DSN_ENV)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        return query.id

    with pytest.raises(StreamingQueryException, match="injected failure"):
        run()
    assert len(injected(sql, target)) == 1
    assert (
        sql.execute(  # type: ignore[index]
            "SELECT count(*) FROM subengine.events WHERE stream = %s", (target,)
        ).fetchone()[0]
        == stored_by_the_failed_run
    )
    db.append(source, orders(5, prefix="after"))
    query_id = run()
    seen = sql.execute(
        "SELECT data->>'id' FROM subengine.events WHERE stream = %s", (target,)
    ).fetchall()
    source_ids = sql.execute(
        "SELECT id::text FROM subengine.events WHERE stream = %s", (source,)
    ).fetchall()
    assert sorted(seen) == sorted(source_ids)
    staged = sql.execute(  # type: ignore[index]
        "SELECT count(*) FROM subengine.spark_staged_events WHERE write_id = %s",
        (f"query:{query_id}",),
    ).fetchone()[0]
    assert staged == 0


class ShiftingRows(DataSource):
    """A source of `rows` rows (key, type, data, computation) in two partitions, which are
    cut differently every time they are computed again: the first time into halves, after
    that into even and odd rows, as an upstream whose output depends on when it runs.
    `computation` counts the times the partition was computed before (from 0)."""

    @classmethod
    def name(cls) -> str:
        return "shifting_rows"

    def schema(self) -> str:
        return "key string, type string, data string, computation int"

    def reader(self, schema: StructType) -> DataSourceReader:
        return ShiftingReader(self.options["stream"], int(self.options["rows"]))


class ShiftingReader(DataSourceReader):
    def __init__(self, stream: str, rows: int) -> None:
        self.stream = stream
        self.rows = rows

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(0), InputPartition(1)]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        half = partition.value
        with psycopg.connect(os.environ[DSN_ENV], autocommit=True) as conn:
            computation = conn.execute(  # type: ignore[index]
                "SELECT count(*) FROM upstream_reads WHERE stream = %s AND half = %s",
                (self.stream, half),
            ).fetchone()[0]
            conn.execute("INSERT INTO upstream_reads VALUES (%s, %s)", (self.stream, half))
        for n in range(self.rows):
            if (n < self.rows // 2) == (half == 0) if computation == 0 else n % 2 == half:
                yield (f"k{n % 13}", "Counted", json.dumps({"n": n}), computation)


class LosingShuffleWrites(SubengineDataSource):
    """The subengine source, writing what ShiftingRows produces (without its computation
    column). A task attempt that received rows of the upstream's first computation fails
    after its rows are written, and the first such attempt first deletes the shuffle
    files it read, as when an executor dies with the shuffle output it served. Spark's
    retry finds the files gone, computes the upstream stage again, and runs the write tasks
    again. Every attempt records the rows it received in the table `write_attempts`."""

    @classmethod
    def name(cls) -> str:
        return "subengine_losing_shuffle"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:  # type: ignore[override]
        written = StructType([f for f in schema.fields if f.name != "computation"])
        return LosingShuffleWriter(super().writer(written, overwrite), self.options["stream"])


class LosingShuffleWriter(DataSourceArrowWriter):
    def __init__(self, writer: BatchWriter, stream: str) -> None:
        self.writer = writer
        self.stream = stream

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        received, computations = [], set()

        def without_computation(batches: Iterator[Any]) -> Iterator[Any]:
            for batch in batches:
                received.extend(batch.column("data").to_pylist())
                computations.update(batch.column("computation").to_pylist())
                yield batch.drop_columns(["computation"])

        message = self.writer.write(without_computation(iterator))
        partition = TaskContext.get().partitionId()  # type: ignore[union-attr]
        with psycopg.connect(os.environ[DSN_ENV], autocommit=True) as conn:
            conn.execute(
                "INSERT INTO write_attempts VALUES (%s, %s, %s, %s)",
                (self.stream, partition, 0 in computations, sorted(received)),
            )
            if 0 not in computations:
                return message
            claimed = conn.execute(
                "INSERT INTO lost_shuffles VALUES (%s) ON CONFLICT DO NOTHING RETURNING 1",
                (self.stream,),
            ).fetchone()
        if claimed:
            lose_newest_shuffle()
        raise RuntimeError(f"injected failure: task {partition} had rows of a lost computation")

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self.writer.commit(messages)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self.writer.abort(messages)


def lose_newest_shuffle() -> None:
    """Delete the files of the newest shuffle in this Spark session's local directory."""
    files = list(Path(os.environ[LOCAL_DIR_ENV]).glob("blockmgr-*/*/shuffle_*"))
    newest = max(int(f.name.split("_")[1]) for f in files)
    for file in files:
        if int(file.name.split("_")[1]) == newest:
            file.unlink()


def test_a_write_stage_rerun_after_a_round_robin_repartition_stores_each_row_once(
    spark: SparkSession, sql: psycopg.Connection[Any], new_stream: Callable[..., str]
) -> None:
    stream = new_stream(partitions=3)
    rows = 200
    # The tasks' bookkeeping tables exist before any task runs: two tasks running
    # CREATE TABLE IF NOT EXISTS at once can both try to create it, and one fails.
    sql.execute("CREATE TABLE IF NOT EXISTS upstream_reads (stream text, half int)")
    sql.execute(
        "CREATE TABLE IF NOT EXISTS write_attempts"
        " (stream text, partition int, first_computation bool, rows text[])"
    )
    sql.execute("CREATE TABLE IF NOT EXISTS lost_shuffles (stream text PRIMARY KEY)")
    frame = (
        spark.read.format("shifting_rows")
        .option("stream", stream)
        .option("rows", str(rows))
        .load()
        .repartition(2)  # round robin
    )
    frame.write.format("subengine_losing_shuffle").option("stream", stream).option(
        "dsnEnv", DSN_ENV
    ).option("writeId", stream).mode("append").save()

    # The upstream ran again, and rows reached other tasks than in the attempts that
    # received the first computation's rows.
    reads = sql.execute(
        "SELECT half, count(*) FROM upstream_reads WHERE stream = %s GROUP BY half ORDER BY half",
        (stream,),
    ).fetchall()
    assert [half for half, count in reads if count >= 2] == [0, 1]
    attempts = sql.execute(
        "SELECT partition, first_computation, rows FROM write_attempts WHERE stream = %s",
        (stream,),
    ).fetchall()
    first = {(partition, tuple(rows)) for partition, early, rows in attempts if early}
    last = {(partition, tuple(rows)) for partition, early, rows in attempts if not early}
    assert first and len(last) == 2 and not first & last

    stored = sql.execute(
        "SELECT data->>'n' FROM subengine.events WHERE stream = %s", (stream,)
    ).fetchall()
    assert sorted(int(n) for (n,) in stored) == list(range(rows))
    assert staged_rows(sql, stream) == 0  # the failed attempts' rows are gone too


def write_rows(
    spark: SparkSession, stream: str, rows: list[Any], schema: str, slices: int = 1, **options: str
) -> None:
    """Write `rows` to `stream` from `slices` Spark partitions, in the order given."""
    frame = spark.createDataFrame(spark.sparkContext.parallelize(rows, slices), schema)
    writer = frame.write.format("subengine").option("stream", stream).option("dsnEnv", DSN_ENV)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


EXPECTING = "key string, type string, data string, expected_version long"


def test_expected_version_is_checked_per_key_and_write(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=1)
    db.append(stream, [NewEvent("a", "T", {}), NewEvent("a", "T", {})])

    # Key a's rows sit in two tasks: the version is the one before the whole write.
    write_rows(
        spark,
        stream,
        [
            ("a", "T", "{}", 2),
            ("b", "T", "{}", 0),
            ("a", "T", '{"n": 2}', None),
            ("a", "T", "{}", 2),
        ],
        EXPECTING,
        slices=2,
    )
    assert db.heads(stream) == {0: 6}
    with pytest.raises(
        PySparkException, match="is at version 5, but the append expected version 2"
    ):
        write_rows(
            spark, stream, [("c", "T", "{}", None), ("a", "T", '{"late": true}', 2)], EXPECTING
        )
    assert db.heads(stream) == {0: 6}


def test_expected_version_counts_the_versions_retention_removed(
    spark: SparkSession, db: subengine.Engine, new_stream: Callable[..., str]
) -> None:
    stream = new_stream(partitions=1)
    db.append(stream, [NewEvent("a", "T", {}), NewEvent("a", "T", {}), NewEvent("b", "T", {})])
    db.set_retention(stream, subengine.Retention(max_events=1))
    assert db.run_retention().removed == 2  # both events of key a are gone

    with pytest.raises(
        PySparkException, match="is at version 2, but the append expected version 0"
    ):
        write_rows(spark, stream, [("a", "T", "{}", 0)], EXPECTING)
    write_rows(spark, stream, [("a", "T", "{}", 2)], EXPECTING)
    assert [e.key_version for e in db.read(stream, 0) if isinstance(e, subengine.Event)] == [1, 3]


def test_rows_of_one_key_in_two_tasks_must_agree_on_expected_version(
    spark: SparkSession, db: subengine.Engine, new_stream: Callable[..., str]
) -> None:
    stream = new_stream(partitions=1)
    with pytest.raises(
        PySparkException, match="rows of key 'a' in this write say expected_version 0 and 1"
    ):
        write_rows(
            spark,
            stream,
            [("a", "T", "{}", 0), ("b", "T", "{}", 0), ("a", "T", "{}", 1)],
            EXPECTING,
            slices=2,
        )
    assert db.heads(stream) == {0: 0}


def test_a_write_run_again_with_other_partitioning_stores_nothing_twice(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=2)
    rows = [(f"k{n % 5}", "Counted", json.dumps({"n": n % 40})) for n in range(120)]
    schema = "key string, type string, data string"
    write_rows(spark, stream, rows, schema, slices=3, writeId="nightly-1")
    write_rows(spark, stream, rows[::-1], schema, slices=2, writeId="nightly-1")
    write_rows(spark, stream, rows, schema, slices=1, writeId="nightly-1")
    stored = sql.execute(
        "SELECT key, type, data::text FROM subengine.events WHERE stream = %s", (stream,)
    ).fetchall()
    # Each row is stored once, identical rows as often as the write holds them.
    assert sorted(stored) == sorted((k, t, json.dumps(json.loads(d))) for k, t, d in rows)
    write_rows(spark, stream, rows, schema, slices=2, writeId="nightly-2")
    assert sum(db.heads(stream).values()) == 2 * len(rows)


def staged_rows(sql: psycopg.Connection[Any], write_id: str) -> int:
    return sql.execute(  # type: ignore[no-any-return, index]
        "SELECT count(*) FROM subengine.spark_staged_events WHERE write_id = %s",
        (f"write:{write_id}",),
    ).fetchone()[0]


class ForgetfulWrites(SubengineDataSource):
    """The subengine source, whose batch writes lose their staged rows before the
    driver's commit, as when PostgreSQL restarts after a crash (the staging table is
    UNLOGGED)."""

    @classmethod
    def name(cls) -> str:
        return "subengine_forgetful"

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        writer = super().writer(schema, overwrite)
        return ForgetfulBatchWriter(writer.target, writer.partitions, writer.write_id)


class ForgetfulBatchWriter(subengine.spark._source.BatchWriter):
    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        with psycopg.connect(os.environ[self.target.dsn_env], autocommit=True) as conn:
            conn.execute(
                "DELETE FROM subengine.spark_staged_events WHERE write_id = %s", (self.write_id,)
            )
        super().commit(messages)


def test_a_write_whose_staged_rows_are_lost_appends_nothing_and_says_so(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
) -> None:
    stream = new_stream(partitions=2)
    frame = spark.createDataFrame(
        spark.sparkContext.parallelize([(f"k{n}", "T", "{}") for n in range(10)], 2),
        "key string, type string, data string",
    )
    with pytest.raises(
        PySparkException, match=r"the rows 2 task\(s\) of this write staged .* are gone"
    ):
        frame.write.format("subengine_forgetful").option("stream", stream).option(
            "dsnEnv", DSN_ENV
        ).option("writeId", f"{stream}-lost").mode("append").save()
    assert db.heads(stream) == {0: 0, 1: 0}
    assert staged_rows(sql, f"{stream}-lost") == 0


def test_derived_ids_are_the_documented_uuids(sql: psycopg.Connection[Any]) -> None:
    content = uuid.uuid4()
    for occurrence in (0, 1, 70_000):
        digest = bytearray(
            hashlib.sha256(content.bytes + occurrence.to_bytes(8, "big")).digest()[:16]
        )
        digest[6] = digest[6] & 0x0F | 0x80
        digest[8] = digest[8] & 0x3F | 0x80
        derived = sql.execute(  # type: ignore[index]
            "SELECT subengine.spark_event_id(%s, %s)", (content, occurrence)
        ).fetchone()[0]
        assert derived == uuid.UUID(bytes=bytes(digest))
        assert derived.version == 8


def test_a_bad_row_fails_the_write_naming_the_row(
    spark: SparkSession, new_stream: Callable[..., str]
) -> None:
    stream = new_stream()
    frame = spark.createDataFrame(
        [("k", "T", "{}"), ("k", "T", "{not json")], "key string, type string, data string"
    )
    with pytest.raises(
        PySparkException, match=r"row 1 of Spark partition 0 \(key 'k'\): data is not valid JSON"
    ):
        frame.coalesce(1).write.format("subengine").option("stream", stream).option(
            "dsnEnv", DSN_ENV
        ).mode("append").save()


# bad options


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("stream", {"stream": "no-such-stream"}, "stream 'no-such-stream' does not exist"),
        ("batch", {"stream": "no-such-stream"}, "stream 'no-such-stream' does not exist"),
        (
            "stream",
            {"dsnEnv": "SUBENGINE_SPARK_TEST_UNSET"},
            "environment variable SUBENGINE_SPARK_TEST_UNSET is not set on the Spark driver",
        ),
        (
            "batch",
            {"dsnEnv": "SUBENGINE_SPARK_TEST_UNSET"},
            "environment variable SUBENGINE_SPARK_TEST_UNSET is not set on the Spark driver",
        ),
        ("stream", {"startingPositions": '{"0": 3,'}, "is not valid JSON"),
        ("stream", {"startingPositions": '{"0": -1}'}, "a position is a whole number from 0"),
        ("stream", {"startingPositions": "subscription:nobody"}, "no subscription named 'nobody'"),
        ("stream", {"partitions": "0,9"}, "there is no partition 9"),
        ("batch", {"since": "yesterday"}, "option since must be an ISO 8601 time with a zone"),
        ("stream", {"dsn": "postgresql://secret"}, "would put connection settings into the query"),
        ("stream", {"startingPosition": "latest"}, "has no option 'startingposition'"),
        ("batch", {"failOnDataLoss": "yes"}, "option failOnDataLoss must be true or false"),
        ("stream", {"failOnDataLoss": "0"}, "option failOnDataLoss must be true or false"),
    ],
)
def test_bad_read_options_fail_before_any_job(
    spark: SparkSession,
    new_stream: Callable[..., str],
    kind: str,
    options: dict[str, str],
    message: str,
) -> None:
    stream = new_stream()
    group = f"bad-options-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "bad options")
    try:
        reader = spark.readStream if kind == "stream" else spark.read
        reader = reader.format("subengine").option("stream", stream).option("dsnEnv", DSN_ENV)
        for key, value in options.items():
            reader = reader.option(key, value)
        with pytest.raises(PySparkException, match=message):
            reader.load()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    assert no_jobs_ran(spark, group)


def test_a_write_without_the_event_columns_fails_before_any_job(
    spark: SparkSession, new_stream: Callable[..., str]
) -> None:
    stream = new_stream()
    group = f"bad-write-{uuid.uuid4().hex}"
    spark.sparkContext.setJobGroup(group, "bad write")
    frame = spark.createDataFrame([("k", "{}")], "key string, data string")
    try:
        with pytest.raises(PySparkException, match="lacks column"):
            frame.write.format("subengine").option("stream", stream).option("dsnEnv", DSN_ENV).mode(
                "append"
            ).save()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    assert no_jobs_ran(spark, group)


# the example pipeline


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "spark_revenue", ROOT / "examples" / "spark_revenue.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_revenue_example_writes_closed_hours_to_parquet_and_closed_days_as_events(
    spark: SparkSession,
    db: subengine.Engine,
    sql: psycopg.Connection[Any],
    new_stream: Callable[..., str],
    tmp_path: Path,
) -> None:
    example = load_example()
    source, target = new_stream(partitions=2), new_stream(partitions=1)
    day = datetime(2026, 3, 1, tzinfo=UTC)
    placed = [
        (day + timedelta(hours=10, minutes=5), 10.50),
        (day + timedelta(hours=10, minutes=40), 4.25),
        (day + timedelta(hours=11, minutes=1), 7),
        (day + timedelta(days=1, hours=9, minutes=30), 100),
        (day + timedelta(days=1, hours=23, minutes=59), 1),
        (day + timedelta(days=2, hours=5, minutes=30), 50),  # moves the watermark to 04:30
    ]
    db.append(
        source,
        [
            NewEvent(f"order-{n}", "OrderPlaced", {"total": total}, occurred_at=moment)
            for n, (moment, total) in enumerate(placed)
        ]
        + [NewEvent("order-0", "OrderPaid", {"total": 999}, occurred_at=day)],
    )

    def run() -> None:
        queries = example.start_queries(
            spark,
            output=tmp_path / "hourly",
            checkpoints=tmp_path / "checkpoints",
            source=source,
            target=target,
            dsn_env=DSN_ENV,
            once=True,
        )
        for query in queries:
            query.awaitTermination()

    run()
    hourly = spark.read.parquet(str(tmp_path / "hourly"))
    got = sorted(
        (row.hour.hour, row.hour.day, float(row.revenue), row.orders) for row in hourly.collect()
    )
    assert got == [(9, 2, 100.0, 1), (10, 1, 14.75, 2), (11, 1, 7.0, 1), (23, 2, 1.0, 1)]
    events = sql.execute(
        "SELECT key, type, data, occurred_at FROM subengine.events WHERE stream = %s ORDER BY key",
        (target,),
    ).fetchall()
    assert events == [
        (
            "revenue-2026-03-01",
            "DailyRevenueComputed",
            {"day": "2026-03-01", "revenue": 21.75, "orders": 3},
            day + timedelta(days=1),
        ),
        (
            "revenue-2026-03-02",
            "DailyRevenueComputed",
            {"day": "2026-03-02", "revenue": 101.0, "orders": 2},
            day + timedelta(days=2),
        ),
    ]
