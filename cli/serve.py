"""`subengine serve`: the HTTP gateway (docs/gateway.md)."""

from __future__ import annotations

import socket

import click

from subengine import Engine, InvalidInput

from ._context import Context, pass_context
from ._errors import CommandError
from ._running import load_app

# the gateway's own paths: a Durable Streams prefix over one of them would hide its streams
_GATEWAY_PATHS = ("/v1", "/ui", "/healthz", "/readyz", "/metrics")


def _require_schema(engine: Engine) -> None:
    """Refuse to serve a database whose schema is missing or older than this code: every
    request would fail on a missing table."""
    from subengine.db._migrate import head_revision

    revision = engine.schema_revision()
    if revision == head_revision():
        return
    where = f"schema {engine.schema!r}"
    state = "does not exist" if revision is None else f"is at revision {revision!r}"
    raise CommandError(
        f"{where} {state}, not {head_revision()!r} as this subengine needs: run "
        "`subengine migrate` first, then `subengine serve`"
    )


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8800, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Server processes sharing the port.",
)
@click.option(
    "--read-dsn",
    envvar="SUBENGINE_READ_DSN",
    show_envvar=True,
    help="Serve reads from this PostgreSQL (a streaming replica); appends, keys and "
    "notifications stay on --dsn.",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    help="Allow browsers on this origin (repeatable); none by default.",
)
@click.option(
    "--heartbeat",
    default=15.0,
    show_default=True,
    type=click.FloatRange(1, 60),
    help="Default seconds of silence before a heartbeat on an event stream.",
)
@click.option(
    "--stream-lifetime",
    default=600.0,
    show_default=True,
    type=click.FloatRange(1, 86400),
    help="Seconds (±10%) before the server closes an event stream; clients resume by cursor.",
)
@click.option(
    "--slow-client-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Seconds a client's socket may take nothing before its event stream is closed "
    "(error slow); it resumes by cursor.",
)
@click.option(
    "--max-connections-per-key",
    default=100,
    show_default=True,
    type=click.IntRange(1),
    help="Open long-polls and event streams one API key may hold per server process; "
    "more are answered 429 with Retry-After.",
)
@click.option(
    "--max-event-streams",
    default=10_000,
    show_default=True,
    type=click.IntRange(1),
    help="Open event streams (SSE and watches) per server process; more are answered 429 "
    "with Retry-After.",
)
@click.option(
    "--max-streams-per-watch",
    default=16,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Streams one watch may follow; more are answered 400.",
)
@click.option(
    "--max-body-bytes",
    default=1 << 20,
    show_default=True,
    type=click.IntRange(1024, 64 << 20),
    help="Largest request body (an append, a watch); larger ones are answered 413.",
)
@click.option(
    "--deliver/--no-deliver",
    default=True,
    show_default=True,
    help="Deliver webhooks from this process (its delivery workers compete with those of "
    "every other gateway process).",
)
@click.option(
    "--delivery-concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Webhook batches this process sends at once.",
)
@click.option(
    "--webhook-failure-timeout",
    default=3600.0,
    show_default=True,
    type=click.FloatRange(1, 30 * 86_400),
    help="Seconds a webhook may fail before it is marked failed (deliveries stop).",
)
@click.option(
    "--webhook-retry-max",
    default=300.0,
    show_default=True,
    type=click.FloatRange(0.1, 86_400),
    help="The longest wait between two attempts to deliver a batch (before jitter).",
)
@click.option(
    "--callback-allow",
    default="",
    metavar="CIDRS",
    help="Internal networks webhook callbacks may reach, comma-separated (e.g. "
    "10.0.0.0/8); without it only public addresses are allowed.",
)
@click.option(
    "--durable-streams/--no-durable-streams",
    default=False,
    show_default=True,
    help="Also speak the Durable Streams protocol under --durable-streams-prefix "
    "(docs/durable-streams.md).",
)
@click.option(
    "--durable-streams-prefix",
    default="/ds",
    show_default=True,
    metavar="PATH",
    help="Where the Durable Streams surface is mounted; any path below it is a stream.",
)
@click.option(
    "--durable-streams-long-poll",
    default=20.0,
    show_default=True,
    type=click.FloatRange(0.1, 300),
    help="Seconds a Durable Streams long-poll waits for data before answering 204.",
)
@click.option(
    "--ui/--no-ui",
    default=True,
    show_default=True,
    help="Serve the status page at /ui (docs/status-page.md).",
)
@click.option(
    "--app",
    "app_spec",
    metavar="MODULE:ATTR",
    help="The app whose handlers the status page's retries of dead letters run.",
)
@click.option(
    "--access-log/--no-access-log",
    default=False,
    show_default=True,
    help="Log one line per request, with cursors, watch ids and tokens redacted.",
)
@pass_context
def serve(
    context: Context,
    host: str,
    port: int,
    workers: int,
    read_dsn: str | None,
    cors_origins: tuple[str, ...],
    heartbeat: float,
    stream_lifetime: float,
    slow_client_timeout: float,
    max_connections_per_key: int,
    max_event_streams: int,
    max_streams_per_watch: int,
    max_body_bytes: int,
    deliver: bool,
    delivery_concurrency: int,
    webhook_failure_timeout: float,
    webhook_retry_max: float,
    callback_allow: str,
    durable_streams: bool,
    durable_streams_prefix: str,
    durable_streams_long_poll: float,
    ui: bool,
    app_spec: str | None,
    access_log: bool,
) -> None:
    """Serve streams over HTTP: pull, long-poll, server-sent events and watches."""
    from subengine.gateway import GatewayConfig
    from subengine.gateway._auth import loopback_name
    from subengine.gateway._callbacks import CallbackPolicy
    from subengine.gateway._delivery import DeliveryConfig
    from subengine.gateway._serve import serve as run

    try:
        policy = CallbackPolicy.from_text(callback_allow)
    except InvalidInput as error:
        raise click.BadParameter(str(error), param_hint="--callback-allow") from None

    prefix = durable_streams_prefix.rstrip("/")
    taken = [path for path in _GATEWAY_PATHS if prefix == path or prefix.startswith(f"{path}/")]
    if not prefix.startswith("/") or "{" in prefix or taken:
        raise click.BadParameter(
            f"a path such as /ds, without '{{' and outside {', '.join(_GATEWAY_PATHS)}",
            param_hint="--durable-streams-prefix",
        )

    if app_spec is not None:
        if not ui:
            raise click.UsageError("--app serves the status page's retries: drop --no-ui")
        load_app(app_spec)  # fail now, not at the first retry
    engine = context.engine()
    _require_schema(engine)
    if not loopback_name(host) and not engine.any_active_api_key():
        raise CommandError(
            f"refusing to listen on {host}: no API key exists, so anyone could read every "
            "stream; create one with 'subengine gateway key create' or listen on 127.0.0.1"
        )
    try:
        socket.getaddrinfo(host, port)
    except OSError as error:
        raise CommandError(f"cannot listen on {host}: {error.strerror}") from None
    config = GatewayConfig(
        heartbeat=heartbeat,
        stream_lifetime=stream_lifetime,
        write_timeout=slow_client_timeout,
        cors_origins=cors_origins,
        max_connections_per_key=max_connections_per_key,
        max_event_streams=max_event_streams,
        max_streams_per_watch=max_streams_per_watch,
        max_body_bytes=max_body_bytes,
        deliver=deliver,
        delivery=DeliveryConfig(
            concurrency=delivery_concurrency,
            failure_timeout=webhook_failure_timeout,
            longest_retry=webhook_retry_max,
        ),
        callback_policy=policy,
        durable_streams=durable_streams,
        durable_streams_prefix=prefix,
        durable_streams_long_poll=durable_streams_long_poll,
        ui=ui,
        ui_app=app_spec,
    )
    run(
        config,
        dsn=engine.dsn,
        schema=engine.schema,
        host=host,
        port=port,
        workers=workers,
        read_dsn=read_dsn,
        log_level=context.log_level or "info",
        access_log=access_log,
    )
