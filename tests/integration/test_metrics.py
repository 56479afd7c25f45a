"""A worker's Prometheus metrics, structured logs and progress lines, against a real
PostgreSQL: in a thread with `metrics_port`, and as the `subengine worker` process."""

from __future__ import annotations

import io
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import (
    Running,
    count,
    expected_lag,
    free_port,
    lag_gauges,
    poisoned_app,
    record,
    scrape,
    value,
    wait_for,
)

import subengine
from subengine import NewEvent
from subengine.model._logging import JsonFormatter
from subengine.worker import _metrics
from subengine.worker._metrics import Progress


@pytest.fixture
def metered_engine(dsn: str, sql: psycopg.Connection[Any]) -> Iterator[subengine.Engine]:
    """Fast polls, retries and progress readings; a 4-partition stream 'orders'."""
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(
        dsn=dsn,
        poll_interval=0.2,
        retry_delay=0.05,
        retry_delay_max=0.1,
        heartbeat_interval=0.5,
        progress_interval=0.1,
    )
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=4)
        yield engine


def first_of_a_partition(stored: list[subengine.Appended]) -> subengine.Appended:
    """An event at position 1, so the first batch of its partition fails."""
    return next(a for a in stored if a.position == 1)


def failed_batches(
    stored: list[subengine.Appended],
    poison: subengine.Appended,
    attempts: int,
    caplog: pytest.LogCaptureFixture,
) -> int:
    """Every batch that failed on the poison: a batch that carried other partitions too
    (as the worker logged; its partitions are then handled one at a time); a batch of
    several events of the poison's partition, then split; and the poison alone
    `attempts` times."""
    shared = sum(
        1 for r in caplog.records if "a batch of several partitions failed" in r.getMessage()
    )
    alone = sum(1 for a in stored if a.partition == poison.partition) == 1
    return shared + (attempts if alone else attempts + 1)


# the metrics endpoint


def test_the_counters_equal_the_events_handled_and_the_lag_gauges_head_minus_position(
    metered_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(40)])
    poison = first_of_a_partition(stored)  # its partition stops there and keeps a lag
    port = free_port()
    with Running(
        poisoned_app("orders", poison, batch_size=7, max_attempts=3, on_error="stop"),
        metered_engine,
        metrics_port=port,
    ):
        wait_for(
            lambda: any(p.stopped for p in metered_engine.subscription_positions("billing")),
            what="the poison's partition to stop",
        )
        more = metered_engine.append("orders", [NewEvent(f"m{n}", "T", {}) for n in range(10)])
        handled = sum(
            1
            for a in stored + more
            if a.partition != poison.partition or a.position < poison.position
        )
        wait_for(lambda: count(sql) == handled, what="every other event")
        wanted_lag = expected_lag(metered_engine, "billing")
        assert wanted_lag[str(poison.partition)] > 0
        wait_for(lambda: lag_gauges(scrape(port)) == wanted_lag, what="the lag gauges to be read")
        samples = scrape(port)
    processed = value(samples, "subengine_events_processed_total", subscription="billing")
    assert processed == count(sql) == handled
    assert value(samples, "subengine_batch_size_events_sum", subscription="billing") == handled
    batches = value(samples, "subengine_batch_size_events_count", subscription="billing")
    assert batches == value(
        samples, "subengine_batch_duration_seconds_count", subscription="billing"
    )
    assert batches > 0  # type: ignore[operator]
    [row] = [
        p
        for p in metered_engine.subscription_positions("billing")
        if p.partition == poison.partition
    ]
    assert row.stopped and row.attempts == 3
    assert value(samples, "subengine_batch_failures_total", subscription="billing") == (
        failed_batches(stored, poison, 3, caplog)
    )
    assert value(samples, "subengine_dead_letters_total", subscription="billing") == 0


def test_a_dead_lettered_event_is_counted(
    metered_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(12)])
    poison = first_of_a_partition(stored)
    port = free_port()
    with Running(
        poisoned_app("orders", poison, batch_size=7, max_attempts=2, on_error="dead_letter"),
        metered_engine,
        metrics_port=port,
    ):
        wait_for(lambda: count(sql) == 11 and count(sql, "subengine.dead_letters") == 1)
        wait_for(
            lambda: lag_gauges(scrape(port)) == dict.fromkeys(map(str, range(4)), 0),
            what="no lag left",
        )
        samples = scrape(port)
    assert value(samples, "subengine_dead_letters_total", subscription="billing") == 1
    assert value(samples, "subengine_batch_failures_total", subscription="billing") == (
        failed_batches(stored, poison, 2, caplog)
    )
    assert value(samples, "subengine_events_processed_total", subscription="billing") == 11


def test_parked_keys_and_their_events_are_counted_and_gauged(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # key p's first event fails, so it and p's two later events are set aside; the others
    # of the partition are handled
    app = subengine.App()
    sub = app.subscription("billing", stream="orders", on_error="park", max_attempts=1)

    @sub.handler()
    def handle(event: subengine.Event, conn: Any) -> None:
        if event.key == "p":
            raise ValueError("poison")
        record(event, conn)

    metered_engine.append("orders", [NewEvent(k, "T", {}) for k in ("p", "q", "p", "q", "p")])
    port = free_port()
    with Running(app, metered_engine, metrics_port=port):
        wait_for(lambda: count(sql) == 2, what="q's events")
        wait_for(
            lambda: value(scrape(port), "subengine_parked_events", subscription="billing") == 3,
            what="the parked gauges to be read",
        )
        samples = scrape(port)
    assert value(samples, "subengine_parked_keys", subscription="billing") == 1
    assert value(samples, "subengine_keys_parked_total", subscription="billing") == 1
    # the failing event is counted with its key; the two set aside after it here
    assert value(samples, "subengine_events_parked_total", subscription="billing") == 2
    assert value(samples, "subengine_events_processed_total", subscription="billing") == 2
    [summary] = metered_engine.subscription_summary("billing")
    assert (summary.parked_keys, summary.parked_events) == (1, 3)


def test_notifications_wake_ups_and_looks_for_work_are_counted(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    port = free_port()
    # a backlog, which a look finds, then appends, which notifications bring
    metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(5)])
    with Running(app, metered_engine, metrics_port=port):
        wait_for(lambda: scrape(port), what="the endpoint")
        wait_for(lambda: count(sql) == 5)
        metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(5)])
        wait_for(lambda: count(sql) == 10)
        wait_for(
            lambda: value(scrape(port), "subengine_wakeups_total", cause="timer") >= 1,  # type: ignore[operator]
            what="a poll timer to expire",
        )
        samples = scrape(port)
    assert value(samples, "subengine_notifications_received_total") >= 1  # type: ignore[operator]
    assert value(samples, "subengine_looks_for_work_total", found_work="true") >= 1  # type: ignore[operator]
    assert value(samples, "subengine_looks_for_work_total", found_work="false") >= 1  # type: ignore[operator]
    assert value(samples, "subengine_wakeups_total", cause="notification") >= 1  # type: ignore[operator]


def test_an_idle_worker_handles_a_notified_append_before_it_looks(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # The slot, idle, is woken by the notification of an append and handles that
    # partition at once: no look finds the work first.
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    port = free_port()
    with Running(app, metered_engine, metrics_port=port):
        wait_for(
            lambda: value(scrape(port), "subengine_looks_for_work_total", found_work="false"),
            what="a first look, which finds nothing",
        )
        for n in range(3):
            metered_engine.append("orders", [NewEvent(f"k{n}", "T", {})])
            wait_for(lambda n=n: count(sql) == n + 1)  # type: ignore[misc]
        samples = scrape(port)
    assert value(samples, "subengine_notifications_received_total") >= 1  # type: ignore[operator]
    assert value(samples, "subengine_looks_for_work_total", found_work="true") in (None, 0)


def test_slots_a_notification_brings_nothing_wait_on_without_a_look(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # Four idle slots, one append at a time: the slot that takes the notified partition
    # handles it, then looks (for work no append announces); the other three, woken
    # with it, find nothing on the board for them and wait again. Each looked after
    # every notification before (about 4 looks per append, 24 here).
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    port = free_port()

    def looks() -> float:
        samples = scrape(port)
        found = value(samples, "subengine_looks_for_work_total", found_work="true") or 0
        return found + (value(samples, "subengine_looks_for_work_total", found_work="false") or 0)

    with Running(app, metered_engine, concurrency=4, metrics_port=port):
        wait_for(lambda: looks() >= 4, what="every slot's first look")
        before = looks()
        for n in range(6):
            metered_engine.append("orders", [NewEvent(f"k{n}", "T", {})])
            wait_for(lambda n=n: count(sql) == n + 1)  # type: ignore[misc]
        looked = looks() - before
    # one look per append (a poll between a commit and its notification sees a head
    # grow, and asks each slot to look)
    assert 6 <= looked <= 6 + 4, f"{looked} looks for 6 appends"


def test_two_workers_in_one_process_keep_their_own_counts(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(8)])
    first, second = subengine.App(), subengine.App()
    first.subscription("billing", stream="orders").handler()(record)
    second.subscription("audit", stream="orders").handler()(lambda event, conn: None)
    ports = free_port(), free_port()
    with (
        Running(first, metered_engine, metrics_port=ports[0]),
        Running(second, metered_engine, metrics_port=ports[1]),
    ):
        for port, name in zip(ports, ("billing", "audit"), strict=True):
            wait_for(
                lambda p=port, n=name: (  # type: ignore[misc]
                    value(scrape(p), "subengine_events_processed_total", subscription=n) == 8
                ),
                what=f"{name}'s count",
            )
        assert (
            value(scrape(ports[0]), "subengine_events_processed_total", subscription="audit")
            is None
        )


def test_a_metrics_port_in_use_is_a_clear_error_and_leaves_no_worker_registered(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        with pytest.raises(subengine.ConfigurationError, match="cannot serve metrics on port"):
            app.run_worker(metered_engine, metrics_port=taken.getsockname()[1])
    assert count(sql, "subengine.workers") == 0


def test_metrics_are_served_on_the_address_asked_for(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    port = free_port()
    with Running(app, metered_engine, metrics_port=port, metrics_address="127.0.0.1"):
        wait_for(lambda: scrape(port), what="the endpoint on 127.0.0.1")
    with pytest.raises(subengine.ConfigurationError, match=r"address 'no-such-host\.invalid'"):
        app.run_worker(metered_engine, metrics_port=port, metrics_address="no-such-host.invalid")
    assert count(sql, "subengine.workers") == 0


# the lag query's cost


@pytest.fixture
def lag_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the worker's lag readings, of the readings it skipped, and of those it
    skipped since its last reading (one or more: that reading found nothing behind)."""
    counts = {"read": 0, "skipped": 0, "skipped since a read": 0}
    read_lag, skip = _metrics.read_lag, Progress.skip

    def counting_read(*args: Any) -> Any:
        counts["read"] += 1
        counts["skipped since a read"] = 0
        return read_lag(*args)

    def counting_skip(self: Progress, now: float) -> None:
        counts["skipped"] += 1
        counts["skipped since a read"] += 1
        skip(self, now)

    monkeypatch.setattr(_metrics, "read_lag", counting_read)
    monkeypatch.setattr(Progress, "skip", counting_skip)
    return counts


def test_an_idle_worker_without_metrics_reads_the_lag_once_until_it_has_work(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any], lag_reads: dict[str, int]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    with Running(app, metered_engine):
        wait_for(lambda: lag_reads["skipped"] >= 5, what="several progress intervals")
        assert lag_reads["read"] == 1  # the reading at start found nothing behind
        metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(5)])
        wait_for(lambda: count(sql) == 5)
        # a reading taken while the batch still ran finds work behind and is followed by
        # another; the worker is idle once a skipped interval follows the last reading
        wait_for(
            lambda: lag_reads["read"] >= 2 and lag_reads["skipped since a read"] >= 1,
            what="a reading after the work that found nothing behind",
        )
        reads = lag_reads["read"]
        skipped = lag_reads["skipped"]
        wait_for(lambda: lag_reads["skipped"] >= skipped + 5, what="several progress intervals")
        assert lag_reads["read"] == reads  # idle again: no more readings


def test_a_worker_serving_metrics_reads_the_lag_every_interval(
    metered_engine: subengine.Engine, lag_reads: dict[str, int]
) -> None:
    app = subengine.App()
    app.subscription("billing", stream="orders").handler()(record)
    with Running(app, metered_engine, metrics_port=free_port()):
        wait_for(lambda: lag_reads["read"] >= 5, what="a reading per interval")
    assert lag_reads["skipped"] == 0


# logs


@pytest.fixture
def json_log() -> Iterator[Callable[[], list[Any]]]:
    """The `subengine` loggers' records at DEBUG and above, formatted as JSON lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("subengine")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_json_log_lines_carry_the_structured_fields(
    metered_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    json_log: Callable[[], list[Any]],
) -> None:
    stored = metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(12)])
    poison = first_of_a_partition(stored)
    with Running(
        poisoned_app("orders", poison, batch_size=7, max_attempts=2, on_error="dead_letter"),
        metered_engine,
    ):
        wait_for(lambda: count(sql) == 11 and count(sql, "subengine.dead_letters") == 1)
    lines = [line for line in json_log() if line["logger"] == "subengine.worker"]
    assert all({"time", "level", "message", "worker_id"} <= set(line) for line in lines)
    [started] = [line for line in lines if "started" in line["message"]]
    assert started["subscriptions"] == ["billing"]
    failures = [line for line in lines if "batch failed" in line["message"]]
    assert [line["attempts"] for line in failures] == [1, 2]
    assert all(
        (line["subscription"], line["partition"]) == ("billing", poison.partition)
        for line in failures
    )
    [gave_up] = [line for line in lines if line["level"] == "ERROR"]
    assert "dead letters" in gave_up["message"]
    batches = [line for line in lines if "from_position" in line]
    assert sum(line["events"] for line in batches) == 11
    for line in batches:
        assert line["to_position"] - line["from_position"] + 1 == line["events"]
        assert line["subscription"] == "billing" and 0 <= line["partition"] < 4


def test_progress_lines_report_a_backlog_until_it_is_caught_up(
    dsn: str, sql: psycopg.Connection[Any], json_log: Callable[[], list[Any]]
) -> None:
    settings = subengine.Settings(dsn=dsn, poll_interval=0.2, progress_interval=0.1)
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("orders", partitions=2)
        engine.append("orders", [NewEvent(f"k{n % 8}", "T", {}) for n in range(300)])
        app = subengine.App()
        app.subscription("billing", stream="orders", batch_size=10).handler()(
            lambda event, conn: conn.execute("SELECT pg_sleep(0.002)")
        )

        def progress() -> list[Any]:
            return [line for line in json_log() if "remaining" in line]

        with Running(app, engine):
            # every event is counted by the first line whose reading follows its commit
            wait_for(
                lambda: sum(line["events"] for line in progress()) == 300,
                what="progress lines accounting for every event",
            )
    lines = progress()
    assert lines[0]["remaining"] > 0
    assert any(line["remaining"] > 0 and line["events"] > 0 for line in lines)
    assert lines[-1]["remaining"] == 0 and lines[-1]["message"].endswith("caught up")
    for line in lines:
        assert line["subscription"] == "billing" and "worker_id" in line
        assert {"rate", "seconds", "eta_seconds"} <= set(line)


# progress arithmetic


# the command


def test_summing_the_lag_gauges_over_workers_counts_each_partition_once(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    # the usual aggregation, sum by (subscription) over every worker's scrape, must give
    # the subscription's lag, however many workers run it
    stored = metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(40)])
    poison = first_of_a_partition(stored)  # its partition stops there and keeps a lag
    app = poisoned_app("orders", poison, batch_size=7, max_attempts=3, on_error="stop")
    ports = [free_port(), free_port()]
    with (
        Running(app, metered_engine, metrics_port=ports[0]),
        Running(app, metered_engine, metrics_port=ports[1]),
    ):
        wait_for(
            lambda: any(p.stopped for p in metered_engine.subscription_positions("billing")),
            what="the poison's partition to stop",
        )
        behind = sum(expected_lag(metered_engine, "billing").values())
        assert behind > 0
        wait_for(
            lambda: (
                sum(sum(lag_gauges(scrape(port)).values()) for port in ports) == behind
                and all(scrape(port) for port in ports)
            ),
            what="the gauges of both workers to add up to the lag",
        )
        time.sleep(0.5)  # several readings later, still once
        assert sum(sum(lag_gauges(scrape(port)).values()) for port in ports) == behind


def test_the_lag_is_exported_when_a_worker_of_lower_id_serves_no_metrics(
    metered_engine: subengine.Engine, sql: psycopg.Connection[Any], dsn: str
) -> None:
    stored = metered_engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(40)])
    poison = first_of_a_partition(stored)
    app = poisoned_app("orders", poison, batch_size=7, max_attempts=3, on_error="stop")
    metered_engine.ensure_subscription(app.subscriptions["billing"])
    # a connected worker of the lowest id there is, running billing without metrics
    quiet = "00000000-0000-0000-0000-000000000000"
    with psycopg.connect(dsn, application_name=f"subengine worker {quiet}") as other:
        other.execute(
            "INSERT INTO subengine.workers (id, host, pid, subscriptions)"
            " VALUES (%s, 'elsewhere', 1, '{billing}')",
            (quiet,),
        )
        other.commit()
        port = free_port()
        with Running(app, metered_engine, metrics_port=port):
            wait_for(
                lambda: any(p.stopped for p in metered_engine.subscription_positions("billing")),
                what="the poison's partition to stop",
            )
            behind = sum(expected_lag(metered_engine, "billing").values())
            wait_for(
                lambda: sum(lag_gauges(scrape(port)).values()) == behind,
                what="the lag gauges",
            )


def test_gaps_passed_and_events_pruned_are_counted(
    dsn: str, sql: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    sql.execute("CREATE TABLE effects (event_id uuid, partition int, position bigint)")
    settings = subengine.Settings(dsn=dsn, poll_interval=0.2, retention_interval=0.2)
    app = subengine.App()
    app.subscription("billing", stream="capped", on_gap="skip").handler()(record)
    port = free_port()
    with subengine.Engine(settings=settings) as engine:
        engine.create_stream("capped", partitions=1, retention=subengine.Retention(max_events=3))
        engine.ensure_subscription(app.subscriptions["billing"])
        engine.pause_subscription("billing")  # the pruner removes what it has not handled
        engine.append("capped", [NewEvent(f"k{n}", "T", {}) for n in range(10)])
        with Running(app, engine, metrics_port=port):
            wait_for(lambda: engine.partitions("capped")[0].floor == 8, what="the pruning")
            engine.resume_subscription("billing")
            wait_for(lambda: count(sql) == 3)
            samples = scrape(port)
    assert value(samples, "subengine_retention_removed_events_total") == 7
    assert value(samples, "subengine_gaps_total", subscription="billing", action="skipped") == 1
    assert value(samples, "subengine_gaps_total", subscription="billing", action="handled") == 0
    assert value(samples, "subengine_gap_events_total", subscription="billing") == 7
    assert any("gap: retention removed positions 1 to 7" in r.getMessage() for r in caplog.records)
