"""The Python client as docs/gateway.md shows it, against a real gateway process; what
`Reader` and `AsyncReader` both do is in test_reader_contract.py, run over both.

Every wait is bounded; no test asserts on how long anything took.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import psycopg
from helpers import ROOT, GatewayProcess

import subengine

# one bound for every wait in these tests
TIMEOUT = 60.0


def test_the_documented_example_keeps_totals_exactly_once(
    engine: subengine.Engine,
    orders: str,
    gateway: GatewayProcess,
    dsn: str,
    sql: psycopg.Connection[Any],
) -> None:
    whole = (ROOT / "docs" / "gateway.md").read_text()
    page = whole[whole.index("## The Python client") :]
    for statement in re.findall(r"```sql\n(.*?)```", page, flags=re.DOTALL):
        sql.execute(statement)
    namespace: dict[str, Any] = {}
    for block in re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL):
        exec(compile(block, "docs/gateway.md", "exec"), namespace)

    def place(start: int, totals: list[int]) -> None:
        engine.append(
            orders,
            [
                subengine.NewEvent(
                    f"order-{start + n}", "OrderPlaced", {"customer": "c", "total": t}
                )
                for n, t in enumerate(totals)
            ],
        )
        engine.append(orders, [subengine.NewEvent("x", "OrderShipped", {"total": 1000})])

    place(0, [1, 2, 3])
    namespace["run"](gateway.url, dsn, follow=False)
    place(3, [10, 20])
    namespace["run"](gateway.url, dsn, follow=False)  # resumes by the stored cursor
    assert sql.execute("SELECT customer, total FROM totals").fetchall() == [("c", 36)]
    [saved] = sql.execute("SELECT cursor FROM reader_cursors").fetchone() or [None]
    place(5, [100])
    totals, after = asyncio.run(asyncio.wait_for(namespace["latest"](gateway.url, saved), TIMEOUT))
    assert totals == [100] and after is not None
