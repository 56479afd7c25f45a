"""`subengine worker`: run the subscriptions of an app until asked to stop."""

from __future__ import annotations

import click

import subengine

from . import _running
from ._context import Context, pass_context

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
LOG_FORMAT_HELP = (
    "json: one object per line (time, level, logger, message and fields such as "
    "subscription, partition, worker_id)."
)


@click.command()
@click.option(
    "--app",
    "app_spec",
    required=True,
    metavar="MODULE:ATTR",
    help="The subengine.App to run, e.g. myproject.consumers:app.",
)
@click.option(
    "--subscription",
    "names",
    multiple=True,
    metavar="NAME",
    help="A subscription to work on (repeatable; default: all the app declares).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    envvar="SUBENGINE_CONCURRENCY",
    show_envvar=True,
    help="Partitions this process handles at once.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    envvar="SUBENGINE_LOG_LEVEL",
    show_envvar=True,
    help="[default: the global --log-level, else info]",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    envvar="SUBENGINE_LOG_FORMAT",
    show_envvar=True,
    help=f"{LOG_FORMAT_HELP} [default: the global --log-format, else text]",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    metavar="PORT",
    envvar="SUBENGINE_METRICS_PORT",
    show_envvar=True,
    help="Serve Prometheus metrics over HTTP on this port.",
)
@click.option(
    "--metrics-address",
    metavar="ADDRESS",
    envvar="SUBENGINE_METRICS_ADDRESS",
    show_envvar=True,
    help="The address the metrics are served on (default: every interface; "
    "127.0.0.1: this host only).",
)
@pass_context
def worker(
    context: Context,
    app_spec: str,
    names: tuple[str, ...],
    concurrency: int,
    log_level: str | None,
    log_format: str | None,
    metrics_port: int | None,
    metrics_address: str | None,
) -> None:
    """Consume subscriptions of an app until SIGTERM/SIGINT (a second one exits at once).

    Subscriptions with plain and with async def handlers run side by side; the async
    ones are awaited on an event loop of the worker's own (docs/async-workers.md).
    """
    stop_signals = context.stop_signals or _running.StopSignals()
    level = log_level or context.log_level or "info"
    json_logs = (log_format or context.log_format) == "json"
    subengine.configure_logging(level, "json" if json_logs else "text")
    app = _running.load_app(app_spec)
    engine = context.engine()
    with engine.connection():
        pass  # wait for PostgreSQL while a signal still means "stopped before starting"
    stop_signals.run(
        lambda stop: app.run_worker(
            engine,
            list(names) or None,
            concurrency=concurrency,
            stop=stop,
            metrics_port=metrics_port,
            metrics_address=metrics_address,
        )
    )
