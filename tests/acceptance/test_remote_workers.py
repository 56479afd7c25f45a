"""Remote workers against real `subengine serve` processes (docs/remote-workers.md): the
protocol over HTTP and its refusals, a waiting claim woken by an append, a reset that
fences a lease, two remote worker processes and a local one sharing a subscription's
partitions under load, and a remote worker killed mid-lease."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import web
from helpers import APPS, ROOT, GatewayProcess, run_subengine, start_subengine, wait_for

import subengine
from subengine import NewEvent, Subscription
from subengine.client import AsyncRemoteWorker, Event, RemoteWorker

EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.xdist_group("remote-workers")


@pytest.fixture
def consumer(engine: subengine.Engine, orders: str) -> str:
    engine.ensure_subscription(Subscription("effects", orders))
    return "effects"


def _url(gateway: GatewayProcess, tail: str) -> str:
    return f"{gateway.url}/v1/subscriptions/{tail}"


def _error(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


def _positions(engine: subengine.Engine, name: str = "effects") -> dict[int, int]:
    return {p.partition: p.position for p in engine.subscription_positions(name)}


def test_claim_ack_and_a_second_ack_over_http(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    appended = engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    claimed = web.post(_url(gateway, "effects/claim"), json={"worker": "w1"})
    assert claimed.status_code == 200, claimed.text
    lease = claimed.json()
    assert [e["id"] for e in lease["events"]] == [str(a.id) for a in appended]
    assert lease["events"][0]["data"] == {"n": 0} and lease["tombstone"] is None
    assert (lease["position"], lease["through"]) == (0, 3)
    ack = web.post(_url(gateway, f"effects/leases/{lease['lease']}/ack"), json={})
    assert ack.status_code == 200 and ack.json()["position"] == 3
    again = web.post(_url(gateway, f"effects/leases/{lease['lease']}/ack"))
    assert _error(again)[:2] == (409, "lease_conflict")
    assert _positions(engine)[appended[0].partition] == 3
    assert web.post(_url(gateway, "effects/claim")).status_code == 204


def test_bad_requests_get_one_line_errors_and_change_nothing(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    engine.ensure_subscription(Subscription("other", "orders"))
    engine.append("orders", [NewEvent("k", "T", {})])
    lease = web.post(_url(gateway, "effects/claim")).json()["lease"]
    cases = [
        (_url(gateway, f"effects/leases/{uuid.uuid4()}/ack"), b"{}", 404, "lease_not_found"),
        (_url(gateway, f"other/leases/{lease}/ack"), b"{}", 404, "lease_not_found"),
        (_url(gateway, "nobody/claim"), b"{}", 404, "subscription_not_found"),
        (_url(gateway, f"effects/leases/{lease}/ack"), b"{not json", 400, "bad_request"),
        (_url(gateway, f"effects/leases/{lease}/ack"), b'{"position": 9}', 400, "bad_request"),
        (_url(gateway, f"effects/leases/{lease}/ack"), b'{"pos": 1}', 400, "bad_request"),
        (_url(gateway, "effects/leases/not-a-uuid/ack"), b"{}", 400, "bad_lease_id"),
        (_url(gateway, f"effects/leases/{lease}/extend"), b'{"lease_seconds": 0}', 400,
         "bad_request"),
        (_url(gateway, "effects/claim"), b'{"wait": "long"}', 400, "bad_request"),
        (_url(gateway, "effects/claim"), b'{"max_events": true}', 400, "bad_request"),
        (_url(gateway, "effects/claim"), b'{"lease_seconds": true}', 400, "bad_request"),
    ]  # fmt: skip
    for url, body, status, code in cases:
        response = web.post(url, content=body, headers={"Content-Type": "application/json"})
        got_status, got_code, message = _error(response)
        assert (got_status, got_code) == (status, code), (url, body, response.text)
        assert message and "\n" not in message
    assert all(position == 0 for position in _positions(engine).values())
    assert web.post(_url(gateway, f"effects/leases/{lease}/ack")).status_code == 200


def test_a_key_needs_consume_on_the_stream(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    _, reader = engine.create_api_key(["read"], ["orders"])
    _, worker = engine.create_api_key(["consume"], ["ord*"])
    engine.append("orders", [NewEvent("k", "T", {})])
    refused = web.post(
        _url(gateway, "effects/claim"), headers={"Authorization": f"Bearer {reader}"}
    )
    assert _error(refused)[:2] == (403, "forbidden")
    allowed = web.post(
        _url(gateway, "effects/claim"), headers={"Authorization": f"Bearer {worker}"}
    )
    assert allowed.status_code == 200


def test_a_waiting_claim_is_answered_when_an_event_is_appended(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    answers: list[httpx.Response] = []
    waiting = threading.Thread(
        target=lambda: answers.append(
            web.post(_url(gateway, "effects/claim"), json={"wait": 20}, timeout=30)
        )
    )
    waiting.start()
    time.sleep(0.5)  # the claim is waiting (it would be answered anyway: it claims first)
    [appended] = engine.append("orders", [NewEvent("k", "T", {})])
    waiting.join(30)
    assert answers and answers[0].status_code == 200
    assert answers[0].json()["events"][0]["id"] == str(appended.id)


def test_a_reset_during_a_lease_makes_its_ack_a_conflict(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(2)])
    lease = web.post(_url(gateway, "effects/claim")).json()
    engine.reset_subscription("effects", "beginning")
    stale = web.post(_url(gateway, f"effects/leases/{lease['lease']}/ack"))
    status, code, message = _error(stale)
    assert (status, code) == (409, "lease_conflict") and "moved" in message
    assert _positions(engine)[lease["partition"]] == 0
    fresh = web.post(_url(gateway, "effects/claim")).json()
    assert fresh["generation"] == lease["generation"] + 1
    assert web.post(_url(gateway, f"effects/leases/{fresh['lease']}/ack")).status_code == 200


class _HeardLost(logging.Handler):
    """Sets `lost` when a remote worker logs that it learnt its lease is lost (it logs
    once it has marked the lease lost, so the next check of the worker sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "was lost" in record.getMessage():
            self.lost.set()


@pytest.fixture
def heard_lost() -> Iterator[threading.Event]:
    handler = _HeardLost()
    logger = logging.getLogger("subengine.client.remote")
    logger.addHandler(handler)
    try:
        yield handler.lost
    finally:
        logger.removeHandler(handler)


def test_a_worker_told_its_lease_is_lost_handles_no_further_event_of_it(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str, heard_lost: threading.Event
) -> None:
    """A reset while the handler works: the next heartbeat gets 409, and the worker stops
    before the lease's next event (the new generation's holder may be handling it)."""
    appended = engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    handled: list[int] = []

    def handler(event: Event) -> None:
        handled.append(event.data["n"])
        if len(handled) == 1:
            engine.reset_subscription("effects", "beginning")
            assert heard_lost.wait(30), "the heartbeat heard of the reset"

    with RemoteWorker(gateway.url, "effects", handler, lease_seconds=1, wait=0) as worker:
        assert worker.run_once() == 1
        assert handled == [0]
        assert _positions(engine)[appended[0].partition] == 0
        assert worker.run_once() == 3  # the new generation's lease: every event, in order
    assert handled == [0, 0, 1, 2]


def test_a_lease_heard_lost_during_its_last_event_is_not_acked(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str, heard_lost: threading.Event
) -> None:
    engine.append("orders", [NewEvent("k", "T", {})])
    sent: list[str] = []

    def handler(event: Event) -> None:
        engine.reset_subscription("effects", "beginning")
        assert heard_lost.wait(30), "the heartbeat heard of the reset"

    client = httpx.Client(
        event_hooks={"request": [lambda r: sent.append(r.url.path)]}, verify=web.TLS
    )
    with RemoteWorker(
        gateway.url, "effects", handler, lease_seconds=1, wait=0, client=client
    ) as worker:
        assert worker.run_once() == 1
    verbs = [path.rsplit("/", 1)[1] for path in sent if "/leases/" in path]
    assert "extend" in verbs and "ack" not in verbs


def test_the_async_worker_told_its_lease_is_lost_handles_no_further_event_of_it(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str, heard_lost: threading.Event
) -> None:
    appended = engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    handled: list[int] = []

    async def handler(event: Event) -> None:
        handled.append(event.data["n"])
        if len(handled) == 1:
            await asyncio.to_thread(engine.reset_subscription, "effects", "beginning")
            assert await asyncio.to_thread(heard_lost.wait, 30), "the heartbeat heard of it"

    async def work() -> tuple[int, int]:
        async with AsyncRemoteWorker(
            gateway.url, "effects", handler, lease_seconds=1, wait=0
        ) as worker:
            return await worker.run_once(), await worker.run_once()

    assert asyncio.run(work()) == (1, 3)
    assert handled == [0, 0, 1, 2]
    assert _positions(engine)[appended[0].partition] == 3


def test_a_worker_cut_off_from_its_gateway_stops_when_its_lease_may_have_expired(
    gateway: GatewayProcess,
    engine: subengine.Engine,
    consumer: str,
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Its gateway stopped (SIGSTOP), a worker's heartbeats go unanswered; its lease
    expires and a worker on another gateway takes the partition and handles every event.
    The first worker, back from its handler, must not handle the rest after it."""
    appended = engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    handled: list[tuple[str, int]] = []

    def record(who: str) -> Any:
        return lambda event: handled.append((who, event.data["n"]))

    with GatewayProcess(cli_env, tmp=tmp_path) as cut_off:
        process = cut_off.process
        assert process is not None
        rescuer = RemoteWorker(gateway.url, "effects", record("rescuer"), wait=10)

        def handler(event: Event) -> None:
            handled.append(("cut-off", event.data["n"]))
            if event.data["n"] == 0:
                process.send_signal(signal.SIGSTOP)
                with rescuer:  # claims once the lease expired, as the gateway saw it
                    assert rescuer.run_once() == 3

        worker = RemoteWorker(cut_off.url, "effects", handler, lease_seconds=1, wait=0)
        try:
            with worker:
                assert worker.run_once() == 1
        finally:
            process.send_signal(signal.SIGCONT)
    assert handled == [("cut-off", 0), ("rescuer", 0), ("rescuer", 1), ("rescuer", 2)]
    assert _positions(engine)[appended[0].partition] == 3


class Processes:
    """Worker processes, local and remote, killed at the end if still running."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`command` as a process; `subengine ...` through `start_subengine`."""
        with open(self.log_dir / f"process-{len(self.started)}.log", "wb") as log:
            options: dict[str, Any] = {
                "cwd": APPS, "env": env or self.env, "stdout": log, "stderr": subprocess.STDOUT
            }  # fmt: skip
            if command[0] == "subengine":
                process = start_subengine(*command[1:], **options)
            else:
                process = subprocess.Popen(list(command), **options)
        self.started.append(process)
        return process

    def remote(self, url: str, name: str, **env: str) -> subprocess.Popen[bytes]:
        script = str(APPS / "remote_worker_app.py")
        return self.start(sys.executable, script, url, "effects", name, env={**self.env, **env})

    def kill_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture
def processes(worker_app_env: dict[str, str], tmp_path: Path) -> Iterator[Processes]:
    started = Processes(worker_app_env, tmp_path)
    yield started
    started.kill_all()


@pytest.fixture
def effects_table(worker_app_env: dict[str, str], sql: psycopg.Connection[Any]) -> None:
    sql.execute("ALTER TABLE effects ADD COLUMN worker text NOT NULL DEFAULT 'local'")


def _effects(sql: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return sql.execute(
        "SELECT event_id, partition, position, worker FROM effects ORDER BY seq"
    ).fetchall()


def test_two_remote_workers_and_a_local_one_share_the_partitions_in_order(
    gateway: GatewayProcess,
    engine: subengine.Engine,
    consumer: str,
    effects_table: None,
    processes: Processes,
    sql: psycopg.Connection[Any],
) -> None:
    engine.set_remote_policy("effects", batch_size=10)
    keys = [f"key-{n}" for n in range(40)]
    appended = engine.append("orders", [NewEvent(keys[n % 40], "T", {"n": n}) for n in range(400)])
    env = {"REMOTE_APP_SLEEP": "0.002"}
    processes.remote(gateway.url, "remote-a", **env)
    processes.remote(gateway.url, "remote-b", **env)
    local_env = {**processes.env, "WORKER_APP_BATCH": "10", "WORKER_APP_SLEEP": "0.002"}
    processes.start("subengine", "worker", "--app", "worker_app:app", env=local_env)
    more = engine.append("orders", [NewEvent(keys[n % 40], "T", {"n": n}) for n in range(400)])
    heads = engine.heads("orders")
    wait_for(lambda: _positions(engine) == heads, "every event acknowledged", timeout=120)
    rows = _effects(sql)
    by_partition: dict[int, list[int]] = defaultdict(list)
    for _, partition, position, _ in rows:
        by_partition[partition].append(position)
    for partition, head in heads.items():
        # each event once, in position order: no batch of a partition was in flight twice
        assert by_partition[partition] == list(range(1, head + 1)), partition
    assert {str(row[0]) for row in rows} == {str(a.id) for a in [*appended, *more]}
    assert {row[3] for row in rows} == {"remote-a", "remote-b", "local"}


def test_a_remote_worker_killed_mid_lease_loses_it_and_another_finishes(
    gateway: GatewayProcess,
    engine: subengine.Engine,
    consumer: str,
    effects_table: None,
    processes: Processes,
    sql: psycopg.Connection[Any],
) -> None:
    engine.append("orders", [NewEvent("one-key", "T", {"n": n}) for n in range(5)])
    victim = processes.remote(gateway.url, "victim", REMOTE_APP_SLEEP="30", REMOTE_APP_LEASE="2")
    leased = "SELECT count(*) FROM subengine.remote_leases WHERE worker = 'victim'"
    wait_for(lambda: sql.execute(leased).fetchone() == (1,), "the victim's lease")
    time.sleep(2.5)  # a heartbeat or two extended it
    victim.kill()
    victim.wait()
    processes.remote(gateway.url, "rescuer", REMOTE_APP_LEASE="2")
    heads = engine.heads("orders")
    wait_for(lambda: _positions(engine) == heads, "the rescuer's acks", timeout=60)
    assert [row[2:] for row in _effects(sql)] == [(n, "rescuer") for n in range(1, 6)]
    ended = sql.execute(
        "SELECT ended FROM subengine.remote_leases WHERE worker = 'victim'"
    ).fetchall()
    assert ended == [("lost",)]


def test_the_node_example_is_a_remote_worker(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str, cli_env: dict[str, str]
) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (.ci/run installs it)")
    appended = engine.append("orders", [NewEvent(f"k{n % 5}", "T", {"n": n}) for n in range(30)])
    env = {**cli_env, "SUBENGINE_GATEWAY": gateway.url, "EXIT_WHEN_IDLE": "1"}
    done = subprocess.run(
        [node, str(EXAMPLES / "remote_worker.mjs"), "effects"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    handled = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(h["id"] for h in handled) == sorted(str(a.id) for a in appended)
    by_partition: dict[int, list[int]] = defaultdict(list)
    for h in handled:
        by_partition[h["partition"]].append(h["position"])
    heads = engine.heads("orders")
    assert {p: positions for p, positions in by_partition.items()} == {
        p: list(range(1, head + 1)) for p, head in heads.items() if head
    }
    assert _positions(engine) == heads


def test_a_failing_handler_nacks_and_the_policy_dead_letters_the_event(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    engine.set_remote_policy("effects", on_error="dead_letter", max_attempts=2)
    appended = engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(3)])
    handled: list[int] = []

    def handler(event: Event) -> None:
        if event.data["n"] == 1:
            raise ValueError("no good")
        handled.append(event.data["n"])

    with RemoteWorker(gateway.url, "effects", handler, wait=0) as worker:
        for _ in range(20):  # each nack waits for its retry (the settings' delay, 1 s)
            worker.run_once()
            if _positions(engine)[appended[0].partition] == 3:
                break
            time.sleep(0.2)
    assert handled == [0, 2]
    [letter] = engine.dead_letters("effects")
    assert letter.position == 2 and "ValueError: no good" in letter.error


def test_the_async_remote_worker_handles_with_coroutines(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    appended = engine.append("orders", [NewEvent("k", "T", {"n": n}) for n in range(4)])
    handled: list[str] = []

    async def handler(event: Event) -> None:
        await asyncio.sleep(0)
        handled.append(str(event.id))

    async def work() -> int:
        async with AsyncRemoteWorker(gateway.url, "effects", handler, wait=1) as worker:
            return await worker.run_once()

    assert asyncio.run(work()) == 4
    assert handled == [str(a.id) for a in appended]
    assert _positions(engine)[appended[0].partition] == 4


def test_a_waiting_claim_gets_a_released_partition_without_an_append(
    gateway: GatewayProcess, engine: subengine.Engine, consumer: str
) -> None:
    engine.append("orders", [NewEvent("k", "T", {})])
    first = web.post(_url(gateway, "effects/claim"), json={"lease_seconds": 60}).json()
    extended = web.post(
        _url(gateway, f"effects/leases/{first['lease']}/extend"), json={"lease_seconds": 120}
    ).json()
    assert extended["deadline"] > first["deadline"]
    answers: list[httpx.Response] = []
    waiting = threading.Thread(
        target=lambda: answers.append(
            web.post(_url(gateway, "effects/claim"), json={"wait": 20}, timeout=30)
        )
    )
    waiting.start()
    time.sleep(0.5)  # the claim waits: the only partition with events is leased
    assert not answers
    released = web.post(_url(gateway, f"effects/leases/{first['lease']}/release"))
    assert released.status_code == 200
    # no notification comes (nothing was appended): the waiting claim's poll finds it
    waiting.join(30)
    assert answers and answers[0].status_code == 200
    second = answers[0].json()
    assert second["partition"] == first["partition"]
    assert [e["id"] for e in second["events"]] == [e["id"] for e in first["events"]]


def test_subscription_leases_lists_who_holds_what(
    engine: subengine.Engine, consumer: str, cli_env: dict[str, str]
) -> None:
    engine.append("orders", [NewEvent("k", "T", {})])
    lease = engine.claim_lease("effects", "mailer-7")
    assert lease is not None
    shown = run_subengine(cli_env, "subscription", "leases", "effects", "--json")
    assert shown.returncode == 0, shown.stderr
    [row] = [json.loads(line) for line in shown.stdout.splitlines()]
    assert (row["worker"], row["partition"], row["id"]) == (
        "mailer-7",
        lease.partition,
        str(lease.id),
    )
    missing = run_subengine(cli_env, "subscription", "leases", "nobody")
    assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1
