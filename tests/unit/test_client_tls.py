"""The clients subengine.client makes itself share one TLS context: httpx builds one per
client (17 ms of CPU), and a program may make a reader per request."""

from __future__ import annotations

import asyncio
import ssl

import pytest

import subengine.client
from subengine.client import _http


def test_the_readers_and_workers_default_clients_verify_with_one_context(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    loads: list[object] = []
    load = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(self)
        load(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    _http._tls.cache_clear()
    request.addfinalizer(_http._tls.cache_clear)  # made while counted: not for other tests
    url = "http://127.0.0.1:9"
    readers = [subengine.client.Reader(url, "orders") for _ in range(3)]
    workers = [subengine.client.RemoteWorker(url, "billing", print) for _ in range(2)]
    for reader in readers:
        reader.close()
    for worker in workers:
        worker.close()

    async def async_ones() -> None:
        reader = subengine.client.AsyncReader(url, "orders")
        await reader.close()
        worker = subengine.client.AsyncRemoteWorker(url, "billing", print)
        await worker.close()

    asyncio.run(async_ones())
    assert len(loads) == 1
