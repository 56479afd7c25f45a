"""The status page's refresher (gateway/_ui_refresher.py) reading real snapshots from
PostgreSQL: a page that comes while a read is under way is woken by that read, and asks
for no other one (twenty pages that open over a few seconds cost one read per refresh)."""

from __future__ import annotations

import asyncio
from itertools import pairwise

import subengine
from subengine.engine._status_page import read_status_snapshot
from subengine.gateway._ui_refresher import PageWake, Refresher

INTERVAL = 0.2


def test_a_page_that_joins_during_a_read_gets_it_and_asks_for_no_other(
    async_engine: subengine.AsyncEngine, runner: asyncio.Runner
) -> None:
    async def run() -> tuple[list[float], bool]:
        loop = asyncio.get_running_loop()
        starts: list[float] = []
        late = PageWake()

        async def read() -> str:
            starts.append(loop.time())
            text = await read_status_snapshot(async_engine)
            if len(starts) == 2:  # a page opens while the second read is under way
                refresher.join(late)
            return text

        closing = asyncio.Event()
        refresher = Refresher(read, closing, interval=INTERVAL)
        first = PageWake()
        refresher.join(first)
        while len(starts) < 2:
            await asyncio.sleep(0.01)
        while refresher.queries == 2 and not late.is_set():
            await asyncio.sleep(0.01)
        woken = late.is_set()  # by the second read's snapshot
        while len(starts) < 4:
            await asyncio.sleep(0.01)
        closing.set()
        await refresher.close()
        return starts, woken

    starts, woken = runner.run(run())
    assert woken
    # a read per interval: the join did not bring the next one forward (the refresher's
    # own clock; a busy machine makes the gaps longer, never shorter)
    gaps = [later - earlier for earlier, later in pairwise(starts)]
    assert min(gaps) >= 0.9 * INTERVAL, gaps
