"""Long-polls after Ray's pubsub (seed 003), on a real `subengine serve` process: one
in-flight long-poll per subscriber session (a newer one answers the older at once, so a
retrying subscriber never holds two places), and replies that gather more events than
the first (`min_events`, `linger`), bounded by `wait`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import GatewayProcess, scrape, value, wait_for

import subengine

TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture
def one_place(cli_env: dict[str, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway where a key may hold one long-poll or event stream at a time."""
    with GatewayProcess(cli_env, "--max-connections-per-key", "1", tmp=tmp_path) as process:
        yield process


def events_url(gateway: GatewayProcess) -> str:
    return f"{gateway.url}/v1/streams/orders/events"


class Poll:
    """A long-poll answered in a thread."""

    def __init__(self, url: str, **params: str) -> None:
        self.answer: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, args=(url, params), daemon=True)
        self._thread.start()

    def _run(self, url: str, params: dict[str, str]) -> None:
        self.answer = httpx.get(url, params={"live": "long-poll", **params}, timeout=TIMEOUT)

    def result(self) -> httpx.Response:
        self._thread.join(60)
        assert self.answer is not None
        return self.answer


def waiting(gateway: GatewayProcess) -> float | None:
    return value(scrape(gateway.port), "subengine_gateway_long_polls_waiting")


def test_a_long_poll_of_a_session_answers_its_older_one_at_once(
    engine: subengine.Engine, orders: str, one_place: GatewayProcess
) -> None:
    start = httpx.get(f"{one_place.url}/v1/streams/orders", timeout=TIMEOUT).json()["cursor"]
    older = Poll(events_url(one_place), after=start, wait="60", session="s-1")
    wait_for(lambda: waiting(one_place) == 1, "the first long-poll to wait")
    # the retry takes the older one's place in the key's limit of one (no 429)
    newer = Poll(events_url(one_place), after=start, wait="60", session="s-1")
    first = older.result()
    assert first.status_code == 204
    assert first.headers["Subengine-Superseded"] == "true"
    assert first.headers["Subengine-Cursor"] == start
    wait_for(lambda: waiting(one_place) == 1, "the newer long-poll to wait")
    engine.append(orders, [subengine.NewEvent("k", "T", {"n": 1})])
    second = newer.result()
    assert second.status_code == 200 and "Subengine-Superseded" not in second.headers
    assert [event["data"]["n"] for event in second.json()["events"]] == [1]
    samples = scrape(one_place.port)
    assert value(samples, "subengine_gateway_long_polls_superseded_total") == 1
    assert value(samples, "subengine_gateway_rejected_total", limit="too_many_connections") == 0


def test_long_polls_of_other_sessions_do_not_answer_each_other(
    orders: str, gateway: GatewayProcess
) -> None:
    polls = [
        Poll(events_url(gateway), after="now", wait="0.5", session=name) for name in ("a", "b")
    ]
    for poll in polls:
        answer = poll.result()
        assert answer.status_code == 204 and "Subengine-Superseded" not in answer.headers


def test_min_events_gathers_a_reply_of_several_appends(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    poll = Poll(events_url(gateway), after="now", wait="60", min_events="3")
    wait_for(lambda: waiting(gateway) == 1, "the long-poll to wait")
    for n in range(3):
        engine.append(orders, [subengine.NewEvent(f"k{n}", "T", {"n": n})])
    answer = poll.result()
    assert answer.status_code == 200
    assert sorted(event["data"]["n"] for event in answer.json()["events"]) == [0, 1, 2]


def test_a_lingering_reply_is_sent_when_wait_ends_with_what_it_gathered(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    poll = Poll(events_url(gateway), after="now", wait="1", linger="60")
    wait_for(lambda: waiting(gateway) == 1, "the long-poll to wait")
    engine.append(orders, [subengine.NewEvent("k", "T", {"n": 1})])
    answer = poll.result()
    assert answer.status_code == 200
    assert [event["data"]["n"] for event in answer.json()["events"]] == [1]


def test_a_lingering_reply_stops_gathering_at_a_full_page(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    poll = Poll(events_url(gateway), after="now", wait="60", linger="60", limit="2")
    wait_for(lambda: waiting(gateway) == 1, "the long-poll to wait")
    for n in range(2):
        engine.append(orders, [subengine.NewEvent("k", "T", {"n": n})])
    answer = poll.result()
    assert answer.status_code == 200
    assert [event["data"]["n"] for event in answer.json()["events"]] == [0, 1]
    assert answer.json()["up_to_date"] is True


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"session": "no spaces"}, "session"),
        ({"session": "x" * 129}, "session"),
        ({"min_events": "101"}, "min_events"),
        ({"min_events": "0"}, "min_events"),
        ({"linger": "61"}, "linger"),
        ({"linger": "-1"}, "linger"),
    ],
)
def test_bad_gathering_parameters_are_refused_naming_them(
    orders: str, gateway: GatewayProcess, params: dict[str, str], named: str
) -> None:
    answer = httpx.get(
        events_url(gateway), params={"live": "long-poll", "wait": "0", **params}, timeout=TIMEOUT
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(named)
