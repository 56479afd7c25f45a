"""The `subengine` command: parses arguments, calls the engine, prints results.

Every error prints as one line on stderr, `error: ...`: errors the engine raises on purpose
(`SubengineError`) exit with status 1, usage errors with status 2 (click's convention).

Starting the command stays cheap (`subengine --help` imports no table renderer, no demo,
no migrations and no database driver of its own): modules that only some commands need
are imported by those commands.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import IO, Any, TypeVar

import click
from subengine.cli import _json, _status, _worker
from subengine.cli._events_file import EventsFile, read_events_file

import subengine
from subengine import _embedded
from subengine._logging import LogFormat, configure_logging
from subengine._names import BIGINT_MAX

F = TypeVar("F", bound=Callable[..., Any])


class Context:
    """What every command shares: the settings, and an engine made on first use."""

    def __init__(self, settings: subengine.Settings) -> None:
        self.settings = settings
        self._engine: subengine.Engine | None = None
        # installed by the group for `subengine worker`, before anything slow
        self.stop_signals: _worker.StopSignals | None = None

    def engine(self) -> subengine.Engine:
        if self._engine is None:
            self._engine = subengine.Engine(settings=self.settings)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def _one_line(message: str) -> str:
    # Messages quote user input with repr(), which escapes line breaks; this catches
    # those that embed text as it is (a file name, click's "extra argument (...)").
    return " ".join(part.strip() for part in message.strip().splitlines() if part.strip())


def handles_errors(command: F) -> F:
    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except subengine.SubengineError as error:
            click.echo(f"error: {_one_line(str(error))}", err=True)
            sys.exit(1)
        except Exception as error:
            import psycopg  # here, not at the top: --help needs no database driver

            if not isinstance(error, psycopg.Error):
                raise
            # one the engine has no better name for
            message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            click.echo(f"error: the database said: {_one_line(message)}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


class OneLineError(click.ClickException):
    """A click error (usage, bad parameter, unreadable file) shown as one line on stderr,
    like every other error of the command, with click's exit status."""

    def __init__(self, error: click.ClickException) -> None:
        message = error.format_message()
        ctx = getattr(error, "ctx", None)
        if isinstance(error, click.UsageError) and ctx is not None:
            message = f"{message.rstrip('.')}; see '{ctx.command_path} --help'"
        super().__init__(_one_line(message))
        self.exit_code = error.exit_code

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.message}", file=file, err=True)


class CommandLine(click.Group):
    """The root group: click's own errors, raised while parsing or by a command, print as
    one line instead of click's usage block."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise  # `subengine` alone prints the help, as before
        except click.ClickException as error:
            raise OneLineError(error) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.NoArgsIsHelpError, OneLineError):
            raise
        except click.ClickException as error:
            raise OneLineError(error) from None


class InvalidSetting(click.ClickException):
    """A setting from the environment or --dsn/--schema is invalid: status 2, as for a
    usage error, without pointing at --help (the fix is in the environment)."""

    exit_code = 2


pass_context = click.make_pass_decorator(Context)


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange lets NaN through (it compares false with both bounds)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if number != number:
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


class IsoTime(click.ParamType):
    """An ISO 8601 time; one without a zone is taken as UTC."""

    name = "TIME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            self.fail(
                f"{_json.shown(value)} is not an ISO 8601 time (e.g. 2026-11-21T10:00:00Z)",
                param,
                ctx,
            )
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@click.group(cls=CommandLine, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dsn", envvar="SUBENGINE_DSN", help="PostgreSQL URL or conninfo [SUBENGINE_DSN].")
@click.option("--schema", envvar="SUBENGINE_SCHEMA", help="Schema of subengine's objects.")
@click.version_option(package_name="subengine")
@click.pass_context
def cli(ctx: click.Context, dsn: str | None, schema: str | None) -> None:
    """subengine: partitioned event streams in PostgreSQL, consumed exactly once."""
    # First, so that a supervisor's SIGTERM during the worker's start-up stops it cleanly.
    stop_signals = _worker.StopSignals() if ctx.invoked_subcommand == "worker" else None
    try:
        settings = subengine.Settings.from_env(dsn=dsn, schema=schema)
    except subengine.SubengineError as error:
        raise InvalidSetting(str(error)) from None
    context = Context(settings)
    context.stop_signals = stop_signals
    ctx.obj = context
    ctx.call_on_close(context.close)


@cli.command()
@click.option("--sql", "as_sql", is_flag=True, help="Print the SQL instead of running it.")
@pass_context
@handles_errors
def migrate(context: Context, as_sql: bool) -> None:
    """Create or upgrade subengine's schema (safe to run from many processes at once)."""
    from subengine import _migrate

    if as_sql:
        click.echo(_migrate.upgrade_sql(context.settings.schema), nl=False)
        return
    engine = context.engine()
    engine.migrate()
    click.echo(f"schema {engine.schema!r} is at revision {engine.schema_revision()}")


@cli.group()
def db() -> None:
    """The database subengine uses (the embedded one when no DSN is given)."""


@db.command("url")
@pass_context
@handles_errors
def db_url(context: Context) -> None:
    """Print the connection URL (starting the embedded PostgreSQL if needed)."""
    click.echo(context.engine().dsn)


@db.command("stop")
@pass_context
@handles_errors
def db_stop(context: Context) -> None:
    """Stop the embedded PostgreSQL of SUBENGINE_HOME."""
    home = context.settings.home.expanduser().resolve()
    if _embedded.stop_embedded(home):
        click.echo(f"stopped the embedded PostgreSQL in {home}")
    else:
        click.echo(f"no embedded PostgreSQL is running in {home}")


@cli.group()
def stream() -> None:
    """Create and inspect streams."""


@stream.command("create")
@click.argument("name")
@click.option("--partitions", type=int, required=True, help="Number of partitions (fixed).")
@pass_context
@handles_errors
def stream_create(context: Context, name: str, partitions: int) -> None:
    """Create stream NAME with a fixed number of partitions."""
    created = context.engine().create_stream(name, partitions)
    click.echo(f"created stream {created.name!r} with {created.partitions} partitions")


@stream.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_context
@handles_errors
def stream_list(context: Context, as_json: bool) -> None:
    """List the streams."""
    streams = context.engine().streams()
    if as_json:
        for s in streams:
            click.echo(
                json.dumps(
                    {
                        "name": s.name,
                        "partitions": s.partitions,
                        "created_at": s.created_at.isoformat(),
                    }
                )
            )
        return
    rows = [
        (s.name, str(s.partitions), s.created_at.isoformat(timespec="seconds")) for s in streams
    ]
    _table(("stream", "partitions", "created_at"), rows)


@stream.command("show")
@click.argument("name")
@pass_context
@handles_errors
def stream_show(context: Context, name: str) -> None:
    """Show the head, head time and floor of every partition of stream NAME."""
    states = context.engine().partitions(name)
    rows = [(str(s.partition), str(s.head), _time(s.head_time), str(s.floor)) for s in states]
    _table(("partition", "head", "head_time", "floor"), rows)


@cli.command()
@click.argument("stream_name", metavar="STREAM")
@click.option("--key", help="Ordering key of the event.")
@click.option("--type", "event_type", help="Event type.")
@click.option("--data", help="Event data as JSON.")
@click.option("--metadata", help="Event metadata as a JSON object.")
@click.option(
    "--id", "event_id", type=click.UUID, help="Event id (UUID); makes retries idempotent."
)
@click.option("--expected-version", type=int, help="Version the key must have (0: new key).")
@click.option(
    "--file",
    "events_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSON Lines file, one event per line ('-' for stdin); all or nothing.",
)
@pass_context
@handles_errors
def append(
    context: Context,
    stream_name: str,
    key: str | None,
    event_type: str | None,
    data: str | None,
    metadata: str | None,
    event_id: uuid.UUID | None,
    expected_version: int | None,
    events_file: Path | None,
) -> None:
    """Append one event, or every event of a JSON Lines file, to STREAM in one transaction."""
    single = [key, event_type, data, metadata, event_id]
    if events_file is not None:
        if any(option is not None for option in single) or expected_version is not None:
            raise click.UsageError(
                "--file cannot be combined with --key/--type/--data/--id/"
                "--metadata/--expected-version"
            )
        events = read_events_file(events_file)
    else:
        if key is None or event_type is None or data is None:
            raise click.UsageError("give --key, --type and --data (or --file)")
        event = subengine.NewEvent(
            key=key,
            type=event_type,
            data=_json_option("--data", data),
            metadata=None if metadata is None else _json_option("--metadata", metadata),
            id=event_id,
        )
        events = [event]
    try:
        stored = context.engine().append(stream_name, events, expected_version)
    except subengine.InvalidEvent as error:
        if isinstance(events, EventsFile):
            raise subengine.InvalidInput(
                f"{events.source} line {events.line_of(error.index)}: {error.reason}"
            ) from None
        raise subengine.InvalidInput(error.reason) from None
    new = [a for a in stored if not a.duplicate]
    for a in stored:
        note = "  (already stored)" if a.duplicate else ""
        click.echo(
            f"partition {a.partition} position {a.position} key version "
            f"{a.key_version} id {a.id}{note}"
        )
    click.echo(f"appended {len(new)} event(s), {len(stored) - len(new)} already stored", err=True)


@cli.command()
@click.argument("stream_name", metavar="STREAM")
@click.option("--partition", type=int, help="Read one partition (default: all, in turn).")
@click.option("--after", type=int, default=0, show_default=True, help="Start after position.")
@click.option(
    "--since",
    type=IsoTime(),
    help="Read by recorded time across partitions (ISO 8601; UTC unless it names a zone).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    help="At most this many events [default: SUBENGINE_READ_LIMIT, 1000].",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event and line.")
@pass_context
@handles_errors
def read(
    context: Context,
    stream_name: str,
    partition: int | None,
    after: int,
    since: datetime | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """Read events of STREAM by position (per partition) or by time (--since).

    When more events follow than --limit shows, a note on stderr says so and how to read on.
    """
    if since is not None and (partition is not None or after):
        raise click.UsageError("--since cannot be combined with --partition or --after")
    engine = context.engine()
    limit = limit or engine.settings.read_limit
    # one event more than is shown tells whether more follow
    wanted = limit + 1 if limit < BIGINT_MAX else limit
    if since is not None:
        events = engine.read_since(stream_name, since, wanted)
    elif partition is not None:
        events = engine.read(stream_name, partition, after, wanted)
    else:
        events = list(_read_all_partitions(engine, stream_name, after, wanted))
    more = len(events) > limit
    events = events[:limit]
    _print_events(events, as_json)
    if more:
        if partition is not None:
            read_on = f"read on with --after {events[-1].position}"
        elif since is not None:
            read_on = "give a later --since or a higher --limit"
        else:
            read_on = "read one partition at a time (--partition, --after) or give a higher --limit"
        click.echo(f"note: stopped at {limit} events (--limit); more follow: {read_on}", err=True)


def _print_events(events: list[subengine.Event], as_json: bool) -> None:
    if as_json:
        for event in events:
            click.echo(json.dumps(_event_json(event), ensure_ascii=False))
        return
    rows = [
        (
            str(e.partition),
            str(e.position),
            e.key,
            str(e.key_version),
            e.type,
            _time(e.recorded_at),
            json.dumps(e.data, ensure_ascii=False),
        )
        for e in events
    ]
    _table(("partition", "position", "key", "version", "type", "recorded_at", "data"), rows)


class StartPoint(click.ParamType):
    """`beginning`, `end`, an ISO 8601 time (UTC unless it names a zone), or a JSON object
    of partition to position."""

    name = "beginning|end|TIME|JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or value in ("beginning", "end"):
            return value
        if value.lstrip().startswith("{"):
            try:
                positions = _json.parse(value)
                if not isinstance(positions, dict):
                    raise ValueError("it is not an object")
                return {_partition(key): position for key, position in positions.items()}
            except ValueError as error:
                self.fail(
                    f"{_json.shown(value)} is not a JSON object of partition to position: {error}",
                    param,
                    ctx,
                )
        return IsoTime().convert(value, param, ctx)


def _partition(key: str) -> int:
    # int() would also take ' 1', '1_0' and digits of other scripts
    if not (key.isascii() and key.isdigit()) or len(key) > len(str(2**31)):
        raise ValueError(f"partition {_json.shown(key)} is not a whole number of a partition")
    return int(key)


@cli.command()
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
    help="Partitions this process handles at once.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one object per line (time, level, logger, message and fields such as "
    "subscription, partition, worker_id).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    metavar="PORT",
    help="Serve Prometheus metrics over HTTP on this port.",
)
@click.option(
    "--metrics-address",
    metavar="ADDRESS",
    help="The address the metrics are served on (default: every interface; "
    "127.0.0.1: this host only).",
)
@pass_context
@handles_errors
def worker(
    context: Context,
    app_spec: str,
    names: tuple[str, ...],
    concurrency: int,
    log_level: str,
    log_format: LogFormat,
    metrics_port: int | None,
    metrics_address: str | None,
) -> None:
    """Consume subscriptions of an app until SIGTERM/SIGINT (a second one exits at once)."""
    stop_signals = context.stop_signals or _worker.StopSignals()
    configure_logging(log_level, log_format)
    app = _worker.load_app(app_spec)
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


@cli.group()
def subscription() -> None:
    """Create, inspect, pause, resume and reset stored subscriptions."""


@subscription.command("create")
@click.argument("name")
@click.option("--stream", "stream_name", required=True, help="The stream it consumes.")
@click.option(
    "--start",
    type=StartPoint(),
    default="beginning",
    show_default=True,
    help="Where it begins: beginning, end, a time, or a JSON map of partition to position.",
)
@pass_context
@handles_errors
def subscription_create(context: Context, name: str, stream_name: str, start: Any) -> None:
    """Store subscription NAME (an app declaring it later must agree on stream and start)."""
    engine = context.engine()
    engine.ensure_subscription(subengine.Subscription(name, stream_name, start))
    _positions_table(engine.subscription_positions(name))


@subscription.command("reset")
@click.argument("name")
@click.option(
    "--to",
    "to",
    type=StartPoint(),
    required=True,
    help="beginning, end, a time (the first event recorded at or after it is next), "
    "or a JSON map of partition to position (only the partitions it names move).",
)
@click.option("--dry-run", is_flag=True, help="Print what the reset would do; change nothing.")
@pass_context
@handles_errors
def subscription_reset(context: Context, name: str, to: Any, dry_run: bool) -> None:
    """Move the positions of NAME at once, in a new generation (workers may run)."""
    engine = context.engine()
    before = {p.partition: p.position for p in engine.subscription_positions(name)}
    after = engine.reset_subscription(name, to, dry_run=dry_run)
    named = set(to) if isinstance(to, dict) else set(after)
    _table(
        ("partition", "position", "after reset", ""),
        [
            (str(p), str(before.get(p, "-")), str(a), "" if p in named else "unchanged")
            for p, a in after.items()
        ],
    )
    if dry_run:
        click.echo("dry run: nothing changed", err=True)


@subscription.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Delete it even while connected workers run it.")
@pass_context
@handles_errors
def subscription_delete(context: Context, name: str, force: bool) -> None:
    """Delete subscription NAME with its positions and dead letters, in one transaction.

    Refused while connected workers run it, unless --force. An app that declares it
    again later stores it anew, from its start point."""
    deleted = context.engine().delete_subscription(name, force=force)
    click.echo(
        f"deleted subscription {deleted.name!r} (stream {deleted.stream!r}): "
        f"{deleted.partitions} positions, {deleted.dead_letters} dead letters"
    )


@subscription.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_context
@handles_errors
def subscription_list(context: Context, as_json: bool) -> None:
    """List the stored subscriptions."""
    rows = [asdict(row) for row in context.engine().subscriptions()]
    if as_json:
        _status.print_json(rows)
    else:
        _status.print_table(rows, _status.SUBSCRIPTION_COLUMNS, "subscriptions")


@subscription.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_context
@handles_errors
def subscription_show(context: Context, name: str, as_json: bool) -> None:
    """Show every partition of subscription NAME: position, lag, state, errors, holder."""
    rows = [asdict(row) for row in context.engine().subscription_status(name)]
    if as_json:
        _status.print_json(rows)
    else:
        _status.print_table(rows, _status.PARTITION_COLUMNS, f"subscription {name}")


@subscription.command("pause")
@click.argument("name")
@pass_context
@handles_errors
def subscription_pause(context: Context, name: str) -> None:
    """Pause NAME: workers take none of its partitions (batches in flight finish)."""
    context.engine().pause_subscription(name)
    click.echo(f"paused subscription {name!r}")


@subscription.command("resume")
@click.argument("name")
@pass_context
@handles_errors
def subscription_resume(context: Context, name: str) -> None:
    """Resume NAME, and restart its stopped partitions."""
    restarted = context.engine().resume_subscription(name)
    note = f"; restarted stopped partitions {', '.join(map(str, restarted))}" if restarted else ""
    click.echo(f"resumed subscription {name!r}{note}")


@cli.command()
@click.option("--subscription", "name", metavar="NAME", help="Only this subscription.")
@click.option("--partitions", is_flag=True, help="One row per partition.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--watch", is_flag=True, help="Redraw until Ctrl-C, with the lag drained.")
@click.option(
    "--interval",
    type=FiniteFloatRange(0.1, 3600),
    default=1.0,
    show_default=True,
    help="Seconds between redraws with --watch.",
)
@pass_context
@handles_errors
def status(
    context: Context,
    name: str | None,
    partitions: bool,
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """Lag and state of every subscription (per partition with --partitions)."""
    engine = context.engine()
    per_partition = partitions or name is not None

    def rows() -> list[dict[str, Any]]:
        if per_partition:
            return [asdict(row) for row in engine.subscription_status(name)]
        return [asdict(row) for row in engine.subscription_summary(name)]

    if as_json:
        if watch:
            raise click.UsageError("--watch cannot be combined with --json")
        _status.print_json(rows())
        return
    columns = _status.PARTITION_COLUMNS if per_partition else _status.SUMMARY_COLUMNS
    if watch:

        def render() -> tuple[Any, int]:
            current = rows()
            lag = sum(int(row["lag"] or 0) for row in current)
            return _status.table(current, columns, "subscriptions"), lag

        _status.watch(render, interval)
        return
    _status.print_table(rows(), columns, "subscriptions")


@cli.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
@handles_errors
def workers(ctx: click.Context, as_json: bool) -> None:
    """The registered workers: host, pid, heartbeat, connected, partitions held."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [asdict(row) for row in ctx.find_object(Context).engine().workers()]
    if as_json:
        _status.print_json(rows)
    else:
        _status.print_table(rows, _status.WORKER_COLUMNS, "workers")


@workers.command("prune")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_context
@handles_errors
def workers_prune(context: Context, as_json: bool) -> None:
    """Remove the registrations of workers that are gone (no connection of theirs open,
    no recent heartbeat); each worker also does this when it starts."""
    rows = [asdict(row) for row in context.engine().prune_workers()]
    if as_json:
        _status.print_json(rows)
        return
    _status.print_table(rows, _status.WORKER_COLUMNS[:6], "removed")


@cli.group("dead-letters")
def dead_letters() -> None:
    """Events a subscription gave up on (policy dead_letter)."""


@dead_letters.command("list")
@click.option("--subscription", "name", metavar="NAME", help="Only this subscription.")
@click.option("--all", "everything", is_flag=True, help="Resolved ones too.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_context
@handles_errors
def dead_letters_list(context: Context, name: str | None, everything: bool, as_json: bool) -> None:
    """List unresolved dead letters, oldest first."""
    rows = [asdict(row) for row in context.engine().dead_letters(name, everything)]
    if as_json:
        _status.print_json(rows)
    else:
        _status.print_table(rows, _status.DEAD_LETTER_COLUMNS, "dead letters")


@dead_letters.command("show")
@click.argument("name")
@click.argument("partition", type=int)
@click.argument("position", type=int)
@pass_context
@handles_errors
def dead_letters_show(context: Context, name: str, partition: int, position: int) -> None:
    """Show one dead letter with its event, as JSON."""
    engine = context.engine()
    letter = next(
        (
            r
            for r in engine.dead_letters(name, everything=True)
            if (r.partition, r.position) == (partition, position)
        ),
        None,
    )
    if letter is None:
        raise subengine.InvalidInput(
            f"subscription {name!r} has no dead letter at partition {partition} position {position}"
        )
    events = engine.read(letter.stream, partition, position - 1, 1)
    row = asdict(letter)
    row["event"] = _event_json(events[0]) if events else None
    _status.print_json([row])


@dead_letters.command("retry")
@click.argument("name")
@click.argument("partition", type=int)
@click.argument("position", type=int)
@click.option("--app", "app_spec", required=True, metavar="MODULE:ATTR", help="The app.")
@pass_context
@handles_errors
def dead_letters_retry(
    context: Context, name: str, partition: int, position: int, app_spec: str
) -> None:
    """Run one dead letter through NAME's handlers again, in a transaction."""
    app = _worker.load_app(app_spec)
    declared = app.subscriptions.get(name)
    if declared is None:
        raise subengine.InvalidInput(f"the app declares no subscription {name!r}")
    error = context.engine().retry_dead_letter(declared, partition, position)
    if error is not None:
        click.echo(f"error: the handlers failed again (recorded): {error}", err=True)
        sys.exit(1)
    click.echo(f"retried: partition {partition} position {position} of {name!r} is handled")


@dead_letters.command("discard")
@click.argument("name")
@click.argument("partition", type=int)
@click.argument("position", type=int)
@pass_context
@handles_errors
def dead_letters_discard(context: Context, name: str, partition: int, position: int) -> None:
    """Mark one dead letter discarded (it stays listed with --all)."""
    context.engine().discard_dead_letter(name, partition, position)
    click.echo(f"discarded: partition {partition} position {position} of {name!r}")


def _positions_table(positions: list[subengine.SubscriptionPosition]) -> None:
    _table(
        ("partition", "position", "generation"),
        [(str(p.partition), str(p.position), str(p.generation)) for p in positions],
    )


@cli.command()
@click.option(
    "--events",
    "event_count",
    type=click.IntRange(100, 100_000),
    default=4000,
    show_default=True,
    help="How many order events the producer appends.",
)
@click.option(
    "--rate",
    type=FiniteFloatRange(10, 100_000),
    default=1000,
    show_default=True,
    help="Events per second the producer aims for.",
)
@pass_context
@handles_errors
def demo(context: Context, event_count: int, rate: float) -> None:
    """Show the engine working: two worker processes project order events while a
    producer appends them; one is killed half-way; the projection is then checked
    against the events exactly (exit 0 only if it matches).

    It writes only into the schema subengine_demo, which it creates and marks (not the
    one of --schema or SUBENGINE_SCHEMA), and refuses a schema of that name it did not
    make."""
    from subengine.cli import _demo

    with subengine.Engine(settings=_demo.settings(context.settings)) as engine:
        ok = _demo.run(engine, event_count, rate, click.echo)
    sys.exit(0 if ok else 1)


def _read_all_partitions(
    engine: subengine.Engine, stream_name: str, after: int, limit: int
) -> Iterator[subengine.Event]:
    remaining = limit
    for state in engine.partitions(stream_name):
        if remaining <= 0:
            return
        batch = engine.read(stream_name, state.partition, after, remaining)
        remaining -= len(batch)
        yield from batch


def _json_option(name: str, value: str) -> Any:
    try:
        return _json.parse(value)
    except ValueError as error:
        raise click.BadParameter(f"not valid JSON: {error}", param_hint=f"'{name}'") from None


def _event_json(event: subengine.Event) -> dict[str, Any]:
    return {
        "id": str(event.id),
        "stream": event.stream,
        "partition": event.partition,
        "position": event.position,
        "key": event.key,
        "key_version": event.key_version,
        "type": event.type,
        "data": event.data,
        "metadata": event.metadata,
        "occurred_at": event.occurred_at.isoformat(),
        "recorded_at": event.recorded_at.isoformat(),
    }


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="milliseconds")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def main() -> None:
    try:
        cli(prog_name="subengine")
    except _worker.StoppedBeforeStart as stopped:
        click.echo(str(stopped), err=True)
        sys.exit(0)
