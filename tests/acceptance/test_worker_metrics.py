"""The `subengine worker` process serves Prometheus metrics and logs JSON lines."""

from __future__ import annotations

import json
import signal
import subprocess
from typing import Any

import psycopg
from helpers import (
    APPS,
    expected_lag,
    free_port,
    lag_gauges,
    scrape,
    start_subengine,
    value,
    wait_for,
)

import subengine
from subengine import NewEvent


def test_the_worker_command_serves_metrics_and_logs_json_lines(
    worker_app_env: dict[str, str], engine: subengine.Engine, sql: psycopg.Connection[Any]
) -> None:
    engine.create_stream("orders", partitions=4)
    engine.append("orders", [NewEvent(f"k{n}", "T", {}) for n in range(30)])
    port = free_port()
    worker = start_subengine(
        "worker",
        "--app",
        "worker_app:app",
        "--metrics-port",
        str(port),
        "--log-format",
        "json",
        "--log-level",
        "debug",
        cwd=APPS,
        env=worker_app_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: (
                value(scrape(port), "subengine_events_processed_total", subscription="effects")
                == 30
            ),
            what="the count of 30 events",
        )
        wait_for(
            lambda: lag_gauges(scrape(port)) == expected_lag(engine, "effects"),
            what="the lag gauges",
        )
        assert set(expected_lag(engine, "effects").values()) == {0}
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    # every line is a JSON object but the signal handler's own one
    lines = [
        json.loads(line)
        for line in stderr.splitlines()
        if not line.startswith("SIGTERM: finishing the current batches")
    ]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    batches = [line for line in lines if "from_position" in line]
    assert sum(line["events"] for line in batches) == 30
    assert {line["subscription"] for line in batches} == {"effects"}
    assert all(line["partition"] in range(4) for line in batches)
