"""The HTTP clients this package makes when its caller passes none.

httpx builds an SSL context for every client it starts, even one that only speaks plain
http: about 17 ms of CPU (OpenSSL 3 reading the certificate authorities). The clients
made here share one, made at the first (so SSL_CERT_FILE and SSL_CERT_DIR are read
then); a caller that wants its own passes its own httpx client.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def new_client() -> httpx.Client:
    return httpx.Client(verify=_tls())


def new_async_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=_tls())
