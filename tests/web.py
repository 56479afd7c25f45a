"""httpx's one-request functions (`web.get(url)` for `httpx.get(url)`...) with one TLS
context for the whole process.

An httpx client builds an SSL context as it starts, even for plain http: 17 ms of CPU
(OpenSSL 3 decoding the system's certificate authorities), and `httpx.get()` and its
siblings start a client for every request. The suite makes thousands of them. Here every
one-off request, and the tests' own httpx clients, verify with one context, made once;
each request still opens a connection of its own. The context is shared: pass no `cert=`
(it would load a certificate into it for every later request).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import httpx

TLS = httpx.create_ssl_context()


def request(method: str, url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.request(method, url, verify=TLS, **arguments)


def get(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.get(url, verify=TLS, **arguments)


def head(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.head(url, verify=TLS, **arguments)


def options(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.options(url, verify=TLS, **arguments)


def post(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.post(url, verify=TLS, **arguments)


def put(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.put(url, verify=TLS, **arguments)


def patch(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.patch(url, verify=TLS, **arguments)


def delete(url: str | httpx.URL, **arguments: Any) -> httpx.Response:
    return httpx.delete(url, verify=TLS, **arguments)


def stream(
    method: str, url: str | httpx.URL, **arguments: Any
) -> AbstractContextManager[httpx.Response]:
    """As `httpx.stream`: a context manager giving the streamed response."""
    return httpx.stream(method, url, verify=TLS, **arguments)
