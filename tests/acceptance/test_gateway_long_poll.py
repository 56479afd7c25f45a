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
import web
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
        self.answer = web.get(url, params={"live": "long-poll", **params}, timeout=TIMEOUT)

    def result(self) -> httpx.Response:
        self._thread.join(60)
        assert self.answer is not None
        return self.answer


def waiting(gateway: GatewayProcess) -> float | None:
    return value(scrape(gateway.port), "subengine_gateway_long_polls_waiting")


def test_a_long_poll_of_a_session_answers_its_older_one_at_once(
    engine: subengine.Engine, orders: str, one_place: GatewayProcess
) -> None:
    start = web.get(f"{one_place.url}/v1/streams/orders", timeout=TIMEOUT).json()["cursor"]
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


def test_a_reply_that_gathered_an_event_over_a_page_reads_on_without_an_error(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """An event whose JSON alone is over a page's 1 MiB (its data compresses, so the
    page's estimate of it is small): a reply still gathering after it read the next
    page with a budget below zero, which was refused with a 400."""
    engine.append(orders, [subengine.NewEvent("k1", "T", {"blob": "a" * 1_048_500})])
    engine.append(orders, [subengine.NewEvent(f"k{n}", "T", {"n": n}) for n in range(2, 6)])
    answer = web.get(
        events_url(gateway),
        params={"live": "long-poll", "key": "k1", "limit": "2", "min_events": "2", "wait": "1"},
        timeout=TIMEOUT,
    )
    assert answer.status_code == 200, answer.text[:300]
    (event,) = answer.json()["events"]
    assert len(event["data"]["blob"]) == 1_048_500


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
    answer = web.get(
        events_url(gateway), params={"live": "long-poll", "wait": "0", **params}, timeout=TIMEOUT
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(named)


def test_long_polls_woken_by_one_append_share_one_read(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """A long-poll woken by an append reads what moved through the hub's shared read, as
    an event stream does: eight long-polls at the head cost one read of the partition,
    and no page of the stream each."""
    engine.append(orders, [subengine.NewEvent("a", "T", {"n": 0})])
    head = web.get(events_url(gateway), timeout=TIMEOUT).headers["Subengine-Cursor"]
    polls = [Poll(events_url(gateway), after=head, wait="30") for _ in range(8)]
    wait_for(lambda: waiting(gateway) == 8, "eight long-polls waiting", timeout=20)
    before = scrape(gateway.port)
    engine.append(orders, [subengine.NewEvent("a", "T", {"n": 1})])
    answers = [poll.result() for poll in polls]
    after = scrape(gateway.port)

    def grew(name: str) -> float:
        return (value(after, name) or 0) - (value(before, name) or 0)

    assert [[e["data"] for e in a.json()["events"]] for a in answers] == [[{"n": 1}]] * 8
    assert grew("subengine_gateway_hub_reads_total") == 1
    assert grew("subengine_gateway_page_reads_total") == 0


def test_a_woken_long_poll_keeps_its_limit_and_its_filter_and_the_cursor_loses_nothing(
    engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    engine.create_stream("spread", partitions=4)
    url = f"{gateway.url}/v1/streams/spread/events"
    head = web.get(url, timeout=TIMEOUT).headers["Subengine-Cursor"]
    keys = [f"k{n}" for n in range(8)]
    limited = Poll(url, after=head, wait="30", limit="3")
    filtered = Poll(url, after=head, wait="30", key="k5")
    wait_for(lambda: waiting(gateway) == 2, "two long-polls waiting", timeout=20)
    engine.append("spread", [subengine.NewEvent(key, "T", {"n": n}) for n, key in enumerate(keys)])
    first = limited.result()
    assert len(first.json()["events"]) == 3
    rest = web.get(url, params={"after": first.headers["Subengine-Cursor"]}, timeout=TIMEOUT)
    # every event once across the two replies
    got = [e["data"]["n"] for e in first.json()["events"] + rest.json()["events"]]
    assert sorted(got) == list(range(8))
    assert [e["key"] for e in filtered.result().json()["events"]] == ["k5"]


def test_a_long_poll_woken_after_its_stream_was_created_again_gets_a_reset_and_every_event(
    engine: subengine.Engine, gateway: GatewayProcess
) -> None:
    """No notification says a stream was deleted and created again (the hub learns it at
    its next head poll): a woken long-poll whose cursor is of the old stream must not take
    the new stream's events after its old position (found in review: 1 and 2 were
    skipped, with no reset)."""
    engine.create_stream("again", partitions=1)
    engine.append("again", [subengine.NewEvent("a", "T", {"n": n}) for n in range(2)])
    url = f"{gateway.url}/v1/streams/again/events"
    head = web.get(url, timeout=TIMEOUT).headers["Subengine-Cursor"]
    poll = Poll(url, after=head, wait="30")
    wait_for(lambda: waiting(gateway) == 1, "the long-poll waiting", timeout=20)
    engine.delete_stream("again")
    engine.create_stream("again", partitions=1)
    engine.append("again", [subengine.NewEvent("b", "T", {"n": n}) for n in (10, 11, 12)])
    page = poll.result().json()
    assert [reset["stream"] for reset in page["resets"]] == ["again"]
    assert [event["data"]["n"] for event in page["events"]] == [10, 11, 12]


def answered_next(
    engine: subengine.Engine, gateway: GatewayProcess, wait: str
) -> tuple[httpx.Response, float]:
    """A long-poll answered by an append, then the next one, sent with its cursor and
    `wait`, answered by another: that answer, and the pages the second one read."""
    head = web.get(events_url(gateway), timeout=TIMEOUT).headers["Subengine-Cursor"]
    first = Poll(events_url(gateway), after=head, wait="30")
    wait_for(lambda: waiting(gateway) == 1, "the first long-poll waiting", timeout=20)
    engine.append("orders", [subengine.NewEvent("a", "T", {"n": 1})])
    cursor = first.result().headers["Subengine-Cursor"]
    before = value(scrape(gateway.port), "subengine_gateway_page_reads_total") or 0
    second = Poll(events_url(gateway), after=cursor, wait=wait)
    wait_for(lambda: waiting(gateway) == 1, "the second long-poll waiting", timeout=20)
    engine.append("orders", [subengine.NewEvent("a", "T", {"n": 2})])
    answer = second.result()
    after = value(scrape(gateway.port), "subengine_gateway_page_reads_total") or 0
    return answer, after - before


def test_a_long_poll_sent_again_with_the_last_cursor_waits_without_reading_a_page(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """The hub knows the heads it answered at (it follows the stream a while after the
    first long-poll left): the next one waits at once, and what wakes it is read through
    the hub's shared read."""
    answer, pages = answered_next(engine, gateway, wait="30")
    assert [event["data"]["n"] for event in answer.json()["events"]] == [2]
    assert pages == 0


def test_a_long_poll_that_waits_less_than_a_head_poll_reads_its_page_first(
    engine: subengine.Engine, orders: str, gateway: GatewayProcess
) -> None:
    """An append committed before it, whose notification the hub has yet to hear of,
    might be found by no head poll before its wait ends: it reads a page, as a pull
    does."""
    answer, pages = answered_next(engine, gateway, wait="0.9")
    assert answer.status_code in (200, 204)
    assert pages >= 1
