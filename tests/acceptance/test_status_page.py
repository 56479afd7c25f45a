"""The gateway's status page at /ui (docs/status-page.md), in headless Chromium against a
real `subengine serve`: it follows a workload live, one snapshot query feeds every open
page, and its actions need an admin key, come only from the page, and change the
database.

Each test saves screenshots of the views it shows under its tmp_path's `screenshots/`
folder (and under $SUBENGINE_TEST_ARTEFACTS/status-page/ when that is set), for review.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
import web
from helpers import APPS, GatewayProcess, Running, record, run_subengine, scrape, value
from helpers import wait_for as wait_for_condition
from playwright.sync_api import Browser, BrowserContext, Page
from subengine.cli import _render  # type: ignore[import-not-found]

import subengine
from subengine.gateway._ui_refresher import REFRESH_SECONDS
from subengine.outside._webhooks import WebhookDefinition, streams_of

WAIT = 30.0
QUERIES = "subengine_gateway_status_page_queries_total"
PAGES = "subengine_gateway_status_page_pages"


def wait_for(condition: Any, what: str, every: float = 0.05) -> None:
    wait_for_condition(condition, what, WAIT, every)


class Shots:
    """Screenshots of the views, kept as the test's artefacts."""

    def __init__(self, tmp_path: Path) -> None:
        self.folder = tmp_path / "screenshots"
        self.folder.mkdir()
        kept = os.environ.get("SUBENGINE_TEST_ARTEFACTS")
        self.kept = Path(kept) / "status-page" if kept else None

    def take(self, page: Page, name: str) -> None:
        path = self.folder / f"{name}.png"
        page.screenshot(path=path, full_page=True)
        if self.kept is not None:
            self.kept.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, self.kept / path.name)

    def every_look(self, page: Page, name: str, ready: str) -> None:
        """`name` at 1280x800 light and dark, and on a narrow screen; `ready` is a
        selector that shows once the view has drawn."""
        for scheme, width, height in (
            ("light", 1280, 800),
            ("dark", 1280, 800),
            ("light", 390, 844),
        ):
            page.emulate_media(color_scheme=scheme)  # type: ignore[arg-type]
            page.set_viewport_size({"width": width, "height": height})
            page.wait_for_selector(ready)
            self.take(page, f"{name}-{scheme}-{width}")
        page.emulate_media(color_scheme="light")
        page.set_viewport_size({"width": 1280, "height": 800})


def version(page: Page) -> int:
    # while the page loads (after signing in, say) there may be no body yet
    return int(page.evaluate("Number((document.body && document.body.dataset.version) || 0)"))


def cell(page: Page, table: str, key: str, label: str) -> str:
    found = page.locator(f'#{table} tr[data-key="{key}"] td[data-label="{label}"]')
    if not found.count():
        return ""
    return str(found.inner_text()).strip()


def go(page: Page, url: str) -> None:
    page.goto(url)
    wait_for(lambda: version(page) >= 1, f"a snapshot on {url}")


def effects_app() -> subengine.App:
    app = subengine.App()
    app.subscription("effects", stream="orders", batch_size=5).handler()(record)
    return app


def test_the_page_follows_a_workload_live_without_a_reload(
    browser: Browser,
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    app = effects_app()
    fast_engine.ensure_subscription(app.subscriptions["effects"])
    secret_query = "token=do-not-show-me"
    fast_engine.put_webhook(
        "orders-hook",
        WebhookDefinition(f"https://hooks.example/orders?{secret_query}", streams_of(["orders"])),
    )
    shots = Shots(tmp_path)
    with GatewayProcess(cli_env, "--no-deliver", tmp=tmp_path) as gateway:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        go(page, f"{gateway.url}/ui")
        page.evaluate("window.loadedOnce = true")
        wait_for(lambda: cell(page, "subscriptions-table", "effects", "lag") == "0", "lag 0")
        # a producer appends while no worker runs: the lag rises, snapshot by snapshot
        for round_ in range(1, 5):
            fast_engine.append(
                "orders",
                [subengine.NewEvent(f"order-{round_}-{n}", "Placed", {}) for n in range(10)],
            )
            total = str(10 * round_)
            wait_for(
                lambda total=total: cell(page, "subscriptions-table", "effects", "lag") == total,
                f"lag {total} on the page",
            )
        assert cell(page, "streams-table", "orders", "appended") == "40"
        shots.every_look(page, "overview-behind", "#subscriptions-table")
        # workers drain it: the page follows down to 0, without a reload
        with Running(app, fast_engine):
            wait_for(lambda: cell(page, "subscriptions-table", "effects", "lag") == "0", "lag 0")
            assert sql.execute("SELECT count(*) FROM effects").fetchone() == (40,)
            assert page.evaluate("window.loadedOnce") is True
            wait_for(
                lambda: cell(page, "subscriptions-table", "effects", "workers") == "1", "a worker"
            )
            shots.every_look(page, "overview", "#subscriptions-table")

            page.click('a[href="#/subscriptions/effects"]')
            wait_for(
                lambda: page.locator("#partitions-table tbody tr").count() == 4, "4 partitions"
            )
            wait_for(lambda: "now 0" in page.inner_text("#chart-caption"), "the chart at 0")
            shown_most = int(re.findall(r"at most (\d+)", page.inner_text("#chart-caption"))[0])
            assert shown_most >= 40  # the chart remembers the lag before the drain
            # numbers and states as `subengine subscription show` prints them
            for row in fast_engine.subscription_status("effects"):
                fields = _render.fields_of(row)
                for label in (
                    "position",
                    "head",
                    "floor",
                    "lag",
                    "state",
                    "attempts",
                    "last_error",
                ):
                    shown = cell(
                        page, "partitions-table", str(row.partition), label.replace("_", " ")
                    )
                    assert shown == _render.cell(fields[label]), (label, shown)
            shots.every_look(page, "subscription", "#partitions-table")

            page.click('a[data-nav="workers"]')
            [worker] = fast_engine.workers()
            key = str(worker.id)
            wait_for(
                lambda: cell(page, "workers-table", key, "pid") == str(worker.pid), "the worker"
            )
            assert cell(page, "workers-table", key, "host") == worker.host
            assert cell(page, "workers-table", key, "started") == _render.cell(worker.started_at)
            assert cell(page, "workers-table", key, "subscriptions") == "effects"
            shots.every_look(page, "workers", "#workers-table")

        page.click('a[data-nav="webhooks"]')
        wait_for(lambda: page.locator("#webhooks-table").count() == 1, "the webhooks")
        callback = cell(page, "webhooks-table", "orders-hook", "callback")
        assert callback == "https://hooks.example/orders"  # never its query: it may be a secret
        assert secret_query not in page.content()
        shots.every_look(page, "webhooks", "#webhooks-table")

        # another site's page cannot act on an open gateway: a browser's cross-site POST (a
        # form's, or a no-cors fetch's) carries that site's origin and not the page's token
        forged = web.post(
            f"{gateway.url}/ui/api/actions",
            content='{"action": "pause", "subscription": "effects"}',
            headers={
                "Origin": "http://evil.example",
                "Sec-Fetch-Site": "cross-site",
                "Content-Type": "text/plain",
            },
        )
        assert forged.status_code == 403
        # nor read it through a DNS name of its own that points here (DNS rebinding)
        rebound = web.get(f"{gateway.url}/ui/api/snapshot", headers={"Host": "evil.example"})
        assert rebound.status_code == 401
        assert not stored("effects", fast_engine).paused
        assert page.evaluate("window.loadedOnce") is True


@contextmanager
def pages(browser: Browser, url: str, count: int) -> Iterator[list[Page]]:
    """`count` pages of `url`, each in a context of its own (a browser opens at most six
    connections per host and profile: twenty event streams need twenty profiles)."""
    contexts: list[BrowserContext] = []
    try:
        opened = []
        for _ in range(count):
            context = browser.new_context(viewport={"width": 800, "height": 600})
            contexts.append(context)
            # every snapshot a page draws: (version, the database's time of it)
            context.add_init_script(
                """window.seen = [];
                new MutationObserver(() => {
                    const body = document.body.dataset;
                    const last = window.seen[window.seen.length - 1];
                    if (body.version && (!last || last[0] !== Number(body.version)))
                        window.seen.push([Number(body.version), body.takenAt]);
                }).observe(document, {attributes: true, subtree: true});"""
            )
            page = context.new_page()
            page.goto(url)
            opened.append(page)
        yield opened
    finally:
        for context in contexts:
            context.close()


def test_twenty_open_pages_cost_one_status_query_per_refresh(
    browser: Browser, engine: subengine.Engine, orders: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    with GatewayProcess(cli_env, tmp=tmp_path) as gateway:
        with pages(browser, f"{gateway.url}/ui", 20) as opened:
            # each look asks all twenty pages: twice a second is often enough
            wait_for(lambda: all(version(p) >= 1 for p in opened), "a snapshot", every=0.5)
            wait_for(lambda: value(scrape_of(gateway), PAGES) == 20, "20 pages following")
            start = max(version(p) for p in opened)
            # a long-poll, the fallback for proxies that cut event streams, waits for the
            # next snapshot too, instead of reading one of its own
            polled = web.get(
                f"{gateway.url}/ui/api/snapshot",
                params={"view": "overview", "after": start, "wait": 10},
                timeout=20,
            )
            assert polled.status_code == 200 and polled.json()["version"] > start
            wait_for(lambda: all(version(p) >= start + 5 for p in opened), "5 more", every=0.5)
            end = min(version(p) for p in opened)
            queries = value(scrape_of(gateway), QUERIES)
            seen = [p.evaluate("window.seen") for p in opened]
    # from the first page on, every snapshot any page drew, by version: each is one read
    # of the database (its own time), the same for every page that drew it
    taken: dict[int, set[str]] = {}
    for each in seen:
        for number, taken_at in each:
            taken.setdefault(number, set()).add(taken_at)
    assert all(len(times) == 1 for times in taken.values()), taken
    # all twenty drew the snapshots after they all were open
    for each in seen:
        assert {number for number, _ in each} >= set(range(start + 1, end + 1))
    # the gateway read the snapshots the pages drew, and no more (one may be under way)
    assert queries is not None and end <= queries <= max(taken) + 1, (queries, max(taken))
    # one per refresh interval (a second), though twenty pages came and follow: by the
    # database's own clock, a second apart on average, and never two back to back
    times = [datetime.fromisoformat(next(iter(taken[n]))) for n in sorted(taken)]
    gaps = [(later - earlier).total_seconds() for earlier, later in pairwise(times)]
    assert len(gaps) >= 5 and min(gaps) >= 0.4 * REFRESH_SECONDS, gaps
    assert sum(gaps) / len(gaps) >= 0.9 * REFRESH_SECONDS, gaps


def scrape_of(gateway: GatewayProcess) -> Any:
    return scrape(gateway.port)


def admin_setup(engine: subengine.Engine, sql: psycopg.Connection[Any]) -> None:
    """Dead letters of subscription `billing` (status_app), parked keys of `shipping`,
    and a gap of `audit`."""
    sys.path.insert(0, str(APPS))
    try:
        from status_app import app  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(APPS))
    sql.execute("CREATE TABLE poison (key text)")
    sql.execute("INSERT INTO poison VALUES ('order-2'), ('order-5')")
    engine.append("orders", [subengine.NewEvent(f"order-{n}", "Placed", {}) for n in range(8)])
    with Running(app, engine):
        wait_for(
            lambda: (
                len(engine.dead_letters("billing")) == 2
                and len(engine.parked_keys("shipping")) == 2
                and sql.execute("SELECT count(*) FROM effects").fetchone() == (12,)
            ),
            "two dead letters, two parked keys and the other events' effects",
        )
    engine.create_stream("short", 1, retention=subengine.Retention(max_events=2))
    audit = subengine.App().subscription("audit", stream="short")
    audit.handler()(record)
    engine.ensure_subscription(audit)
    engine.append("short", [subengine.NewEvent("k", "T", {}) for _ in range(5)])
    engine.run_retention("short")
    [gap] = engine.subscription_status("audit")
    assert gap.state == "gap"


def sign_in(page: Page, url: str, token: str) -> None:
    page.goto(f"{url}/ui")
    page.fill("#key", token)
    page.click("button[type=submit]")
    wait_for(lambda: version(page) >= 1, "the page after signing in")


def act(page: Page, selector: str, confirm: bool = True) -> str:
    """Click the button, confirm in the dialog, and return what the page then says."""
    page.locator("#notice").evaluate("node => node.replaceChildren()")
    page.click(selector)
    page.wait_for_selector("dialog#confirm[open]")
    page.click("#confirm-button" if confirm else "dialog#confirm button[value=cancel]")
    if not confirm:
        return ""
    page.wait_for_selector("#notice p")
    return str(page.inner_text("#notice p"))


def test_actions_need_an_admin_key_and_change_the_database(
    browser: Browser,
    fast_engine: subengine.Engine,
    sql: psycopg.Connection[Any],
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    admin_setup(fast_engine, sql)
    _, admin = fast_engine.create_api_key(["admin"], ["*"], name="ops")
    _, reader = fast_engine.create_api_key(["read"], ["*"], name="dashboard")
    # the apps before, not instead of, the path that finds this checkout's subengine
    env = dict(
        cli_env, PYTHONPATH=os.pathsep.join(filter(None, [str(APPS), cli_env.get("PYTHONPATH")]))
    )
    shots = Shots(tmp_path)
    billing_url_part = "#/subscriptions/billing"
    with GatewayProcess(env, "--app", "status_app:app", "--access-log", tmp=tmp_path) as gateway:
        # a read key: the page shows everything, and no button
        reading = browser.new_context(viewport={"width": 1280, "height": 800})
        page = reading.new_page()
        page.goto(f"{gateway.url}/ui")
        assert page.locator("#key").count() == 1  # keys exist: sign in first
        shots.take(page, "sign-in")
        sign_in(page, gateway.url, reader)
        page.goto(f"{gateway.url}/ui{billing_url_part}")
        wait_for(lambda: page.locator("#dead-letters-table tbody tr").count() == 2, "2 letters")
        assert page.locator("main button").count() == 0
        [cookie] = reading.cookies()
        assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"]) == (
            "subengine_ui_key",
            True,
            "Strict",
        )
        assert page.evaluate("document.cookie") == ""  # the page's scripts never see the key
        shots.every_look(page, "subscription-read-key", "#dead-letters-table")
        refused = page.evaluate(
            """async () => {
                const csrf = document.querySelector('meta[name="subengine-csrf"]').content;
                const answer = await fetch("/ui/api/actions", {method: "POST",
                    headers: {"Content-Type": "application/json", "Subengine-Csrf": csrf},
                    body: JSON.stringify({action: "pause", subscription: "billing"})});
                return [answer.status, (await answer.json()).error.message];
            }"""
        )
        assert refused[0] == 403 and "admin scope" in refused[1]
        assert not stored("billing", fast_engine).paused

        # an admin key: every action, after a confirmation, says what it did
        admin_context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = admin_context.new_page()
        sign_in(page, gateway.url, admin)
        page.goto(f"{gateway.url}/ui{billing_url_part}")
        wait_for(lambda: page.locator("#dead-letters-table tbody tr").count() == 2, "2 letters")
        shots.every_look(page, "subscription-admin", "#dead-letters-table")
        act(page, '[data-focus="pause:billing"]', confirm=False)
        assert not stored("billing", fast_engine).paused  # cancelled: nothing done
        # by keyboard: the button, then the dialog's Confirm after its Cancel
        page.focus('[data-focus="pause:billing"]')
        page.keyboard.press("Enter")
        page.wait_for_selector("dialog#confirm[open]")
        # each key goes to what has the focus once the browser has moved it: on a busy
        # machine a key pressed at once could still reach the element before
        page.wait_for_function("document.activeElement.value === 'cancel'")
        page.keyboard.press("Tab")
        page.wait_for_function("document.activeElement.id === 'confirm-button'")
        page.keyboard.press("Enter")
        page.wait_for_selector("#notice p")
        assert page.inner_text("#notice p") == "paused subscription 'billing'"
        assert stored("billing", fast_engine).paused
        wait_for(lambda: page.locator('[data-focus="resume:billing"]').count() == 1, "Resume")
        assert act(page, '[data-focus="resume:billing"]') == "resumed subscription 'billing'"
        assert not stored("billing", fast_engine).paused

        letters = {d.key: d for d in fast_engine.dead_letters("billing")}
        fixed, dropped = letters["order-2"], letters["order-5"]
        sql.execute("DELETE FROM poison WHERE key = 'order-2'")
        said = act(page, f'[data-focus="retry:{fixed.partition}:{fixed.position}"]')
        assert said.startswith("retried the dead letter") and said.endswith("it is handled")
        said = act(page, f'[data-focus="discard:{dropped.partition}:{dropped.position}"]')
        assert said.startswith("discarded the dead letter")
        resolutions = sql.execute(
            "SELECT position, resolution FROM subengine.dead_letters ORDER BY position"
        ).fetchall()
        assert sorted(resolutions) == sorted(
            [(fixed.position, "retried"), (dropped.position, "discarded")]
        )
        assert sql.execute("SELECT count(*) FROM effects").fetchone() == (13,)
        wait_for(lambda: page.locator("#dead-letters-table tr").count() == 0, "no letter left")

        page.goto(f"{gateway.url}/ui#/subscriptions/shipping")
        wait_for(lambda: page.locator("#parked-table tbody tr").count() == 2, "2 parked keys")
        shots.take(page, "subscription-parked-keys")
        said = act(page, '[data-focus="retry-key:order-2"]')
        assert said == (
            "retried: 1 event(s) of key 'order-2' of 'shipping' handled in order; the key is clear"
        )
        said = act(page, '[data-focus="discard-key:order-5"]')
        assert said == "discarded: 1 event(s) of key 'order-5' of 'shipping'; the key is clear"
        assert fast_engine.parked_keys("shipping") == []
        assert sql.execute("SELECT count(*) FROM effects").fetchone() == (14,)

        page.goto(f"{gateway.url}/ui#/subscriptions/audit")
        wait_for(lambda: page.locator('[data-focus="skip:0"]').count() == 1, "Skip gap")
        said = act(page, '[data-focus="skip:0"]')
        assert "skipped the gap: retention removed positions 1 to 3" in said
        assert sql.execute("SELECT action FROM subengine.gaps").fetchall() == [("accepted",)]
        assert fast_engine.subscription_status("audit")[0].state != "gap"

        # without the page's token, an action is refused, even with the admin's cookie
        status = page.evaluate(
            """async () => (await fetch("/ui/api/actions", {method: "POST",
                headers: {"Content-Type": "application/json"},
                body: JSON.stringify({action: "pause", subscription: "billing"})})).status"""
        )
        assert status == 403
        assert not stored("billing", fast_engine).paused

        # a revoked key's page goes back to the sign-in form
        [key] = [k for k in fast_engine.api_keys() if k.name == "ops"]
        fast_engine.revoke_api_key(key.id)
        # (once the revocation's notification reached the gateway: reload until then)
        wait_for(lambda: page.reload() and page.locator("#key").count() == 1, "sign-in")
        log = gateway.output()
    for secret in (admin, reader, "sek_"):
        assert secret not in log
    assert "POST /ui/api/actions" in log  # the log is on, and says nothing secret


def test_a_confirmation_opened_as_the_last_one_closes_is_answered_by_its_own_button(
    browser: Browser, fast_engine: subengine.Engine, cli_env: dict[str, str], tmp_path: Path
) -> None:
    fast_engine.ensure_subscription(effects_app().subscriptions["effects"])
    with GatewayProcess(cli_env, "--no-deliver", tmp=tmp_path) as gateway:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        go(page, f"{gateway.url}/ui#/subscriptions/effects")
        pause = '[data-focus="pause:effects"]'
        page.wait_for_selector(pause)
        page.click(pause)
        page.wait_for_selector("dialog#confirm[open]")
        # the browser fires a dialog's `close` event a moment after it closes, and input
        # may come first (Cancel, then Enter on the button the focus went back to): here
        # Pause opens the dialog again before the Cancel's event comes
        page.evaluate(
            """async (pause) => {
                const dialog = document.getElementById("confirm");
                const cancelled = new Promise((resolve) =>
                    dialog.addEventListener("close", resolve, {once: true}));
                dialog.querySelector("button[value=cancel]").click();
                document.querySelector(pause).click();
                await cancelled;
            }""",
            pause,
        )
        assert page.locator("dialog#confirm[open]").count() == 1
        page.click("#confirm-button")
        page.wait_for_selector("#notice p")
        assert page.inner_text("#notice p") == "paused subscription 'effects'"
        assert stored("effects", fast_engine).paused


def stored(name: str, engine: subengine.Engine) -> subengine.StoredSubscription:
    [found] = [s for s in engine.subscriptions() if s.name == name]
    return found


def test_serve_no_ui_serves_no_page_and_a_bad_app_stops_serve_at_once(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    with GatewayProcess(cli_env, "--no-ui", tmp=tmp_path) as gateway:
        for path in ("/ui", "/ui/api/live", "/ui/static/app.js"):
            answer = web.get(f"{gateway.url}{path}")
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
    done = run_subengine(cli_env, "serve", "--app", "no_such_module:app")
    assert done.returncode != 0
    assert "--app no_such_module:app: cannot import 'no_such_module'" in done.stderr
