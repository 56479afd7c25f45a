"""Running the gateway with uvicorn: `subengine serve`.

Each server process builds its application from the environment (`app_from_environment`),
so that `--workers N` runs N processes sharing one listening socket. On shutdown the
server first ends every open event stream (each says why: `close` frame `shutdown`), so it
never waits on them.
"""

from __future__ import annotations

import dataclasses
import gc
import ipaddress
import json
import os
import signal

import uvicorn
from starlette.applications import Starlette

from subengine.gateway._access_log import redact_access_log
from subengine.gateway._app import create_app
from subengine.gateway._callbacks import CallbackPolicy
from subengine.gateway._delivery import DeliveryConfig
from subengine.gateway._state import GatewayConfig
from subengine.model._settings import Settings

CONFIG_ENVIRONMENT = "SUBENGINE_GATEWAY_CONFIG"
# A cursor of many partitions travels in a header (Last-Event-ID) and in URLs.
_MAX_HEAD_BYTES = 64 * 1024


def app_from_environment() -> Starlette:
    """The application of one server process, configured by `serve` through the
    environment."""
    redact_access_log()
    given = json.loads(os.environ.get(CONFIG_ENVIRONMENT, "{}"))
    read_dsn = given.pop("read_dsn", None)
    if "delivery" in given:
        given["delivery"] = DeliveryConfig(**given["delivery"])
    if "callback_policy" in given:
        policy = given["callback_policy"]
        networks = tuple(ipaddress.ip_network(text) for text in policy.pop("allow"))
        given["callback_policy"] = CallbackPolicy(allow=networks, **policy)
    config = GatewayConfig(**{**given, "cors_origins": tuple(given.get("cors_origins", ()))})
    app = create_app(
        config, end_streams_on_signals=True, settings=Settings.from_env(), read_dsn=read_dsn
    )
    # What the process holds by now (modules, the application: some 56,000 objects) lives
    # as long as it does, yet each full collection walks it all again: 10 ms, about once
    # per 45 appends of 500 events (each makes some 3,000 objects), 0.4 ms of the 1.6 ms
    # of Python such an append takes (issue 26). Frozen, the collector walks only what
    # requests make. The process is the server's alone: an application that mounts
    # `create_app` in its own keeps its own collector's settings.
    gc.freeze()
    return app


def serve(
    config: GatewayConfig,
    *,
    dsn: str,
    schema: str,
    host: str,
    port: int,
    workers: int,
    read_dsn: str | None,
    log_level: str,
    access_log: bool,
) -> None:
    """Serve until SIGINT or SIGTERM. `dsn` is the resolved DSN of the database (the
    embedded server's too), handed to every server process."""
    os.environ["SUBENGINE_DSN"] = dsn
    os.environ["SUBENGINE_SCHEMA"] = schema
    os.environ[CONFIG_ENVIRONMENT] = json.dumps(
        {**dataclasses.asdict(config), "read_dsn": read_dsn}, default=str
    )
    # uvicorn raises the signal that stopped it again once it has shut down; a graceful
    # stop is a success here, as it is for `subengine worker`
    stopped = {number: signal.signal(number, _stopped) for number in _STOP_SIGNALS}
    try:
        uvicorn.run(
            "subengine.gateway._serve:app_from_environment",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=5,
            h11_max_incomplete_event_size=_MAX_HEAD_BYTES,
            proxy_headers=False,
            server_header=False,
        )
    finally:
        for number, handler in stopped.items():
            signal.signal(number, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stopped(signum: int, frame: object) -> None:
    """What the stop signals do once uvicorn has shut down: nothing more."""
