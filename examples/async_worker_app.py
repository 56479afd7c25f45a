"""A FastAPI application that runs subengine's async worker inside its own event loop for
as long as it serves (a Starlette application takes the same `lifespan=` function).

    SUBENGINE_DSN=postgresql://... uvicorn examples.async_worker_app:app

Its async handler writes through a SQLAlchemy AsyncSession bound to the batch's
connection, so the row and the subscription's position commit together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from sqlalchemy import text

import subengine

consumers = subengine.App()
totals = consumers.subscription("totals", stream="orders", start="beginning")


@totals.handler("OrderPlaced")
async def order_placed(event: subengine.Event, conn: Any) -> None:
    async with subengine.async_sqlalchemy_session(conn) as session:
        await session.execute(
            text(
                "INSERT INTO order_totals (key, total) VALUES (:key, :total)"
                " ON CONFLICT (key) DO UPDATE SET total = order_totals.total + :total"
            ),
            {"key": event.key, "total": event.data["total"]},
        )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = subengine.AsyncEngine()  # SUBENGINE_DSN; the app appends with it too
    worker = subengine.AsyncWorker(engine, list(consumers.subscriptions.values()))
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    app.state.worker = worker
    try:
        yield
    finally:
        stop.set()
        await running  # the current batches finish; an error that stopped it is raised
        await engine.close()


app = FastAPI(lifespan=lifespan)


@app.get("/health")
async def health(request: Request) -> dict[str, str | None]:
    worker = request.app.state.worker.worker
    return {"worker": str(worker.id) if worker else None}
