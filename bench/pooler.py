"""What a transaction-mode pooler costs a live tail (docs/pooler.md): the time from an
append's return to the event reaching `Engine.tail`, at 50 events/s, for a tail
connected straight to PostgreSQL, one behind PgBouncer with SUBENGINE_DIRECT_DSN (pushed
to), and one behind PgBouncer with no direct connection (poll-only, at two poll
intervals); rounds in rotating order. The appends go the way the tail's engine connects.

    .venv/bin/python bench/pooler.py            # about two minutes
    .venv/bin/python bench/pooler.py --quick    # a smoke test

It needs PgBouncer (Debian's `pgbouncer` package) and runs it on a free loopback port in
transaction mode, pool of 4, in front of a database of its own
(`bench_pooler_<pid>`, dropped at the end).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import _harness as bench
import psycopg
from _harness import percentile, progress
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import subengine
from subengine import NewEvent

STREAM = "bench-pooler"
RATE = 50.0
clock = time.perf_counter


@dataclass
class Variant:
    name: str
    settings: subengine.Settings
    latencies: list[float] = field(default_factory=list)
    round_p50: list[float] = field(default_factory=list)


@contextmanager
def pgbouncer(dsn: str) -> Iterator[str]:
    """The DSN of `dsn`'s database through a PgBouncer of this run."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(binary):
        raise SystemExit("bench/pooler.py needs PgBouncer: apt-get install pgbouncer")
    params = conninfo_to_dict(dsn)
    keys = ("host", "port", "user", "password")
    server = " ".join(f"{k}={params[k]}" for k in keys if params.get(k))
    run_as: list[str] = []
    if os.geteuid() == 0:  # PgBouncer refuses root
        names = [n for n in ("pgserver", "nobody") if n in {u.pw_name for u in pwd.getpwall()}]
        run_as = ["-u", names[0]]
    directory = Path(tempfile.mkdtemp(prefix="bench-pgbouncer-"))
    directory.chmod(0o777)
    port = bench.free_port()
    ini = directory / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\n* = {server}\n[pgbouncer]\nlisten_addr = 127.0.0.1\n"
        f"listen_port = {port}\nunix_socket_dir =\nauth_type = any\npool_mode = transaction\n"
        "default_pool_size = 4\nmax_client_conn = 100\n"
        f"ignore_startup_parameters = extra_float_digits,options\nlogfile = {directory}/log\n"
    )
    ini.chmod(0o644)
    process = subprocess.Popen([binary, "-q", *run_as, str(ini)])
    through = make_conninfo(host="127.0.0.1", port=port, dbname=params["dbname"],
                            user=params.get("user", ""))  # fmt: skip
    try:
        for _ in range(100):
            try:
                psycopg.connect(through, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                time.sleep(0.1)
        yield through
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def one_round(variant: Variant, seconds: float) -> None:
    """Append at RATE for `seconds` and note when the tail gets each event."""
    received: dict[int, float] = {}
    ready, stop = threading.Event(), threading.Event()
    with subengine.Engine(settings=variant.settings) as engine:
        heads = engine.heads(STREAM)

        def read() -> None:
            after = subengine.Cursor.at(STREAM, heads)
            with engine.tail(STREAM, after=after) as tail:
                tail.next_event(timeout=0.01)
                ready.set()
                while not stop.is_set():
                    event = tail.next_event(timeout=0.1)
                    if isinstance(event, subengine.Event):
                        received[event.position] = clock()

        reader = threading.Thread(target=read)
        reader.start()
        ready.wait(60)
        time.sleep(0.5)  # its listener connected, where it has one
        appended: dict[int, float] = {}
        first = clock()
        for n in range(int(seconds * RATE)):
            delay = first + n / RATE - clock()
            if delay > 0:
                time.sleep(delay)
            [stored] = engine.append(STREAM, [NewEvent("k", "Tick", {"n": n})])
            appended[stored.position] = clock()
        deadline = clock() + 30
        while len(received) < len(appended) and clock() < deadline:
            time.sleep(0.01)
        stop.set()
        reader.join(30)
    missing = set(appended) - set(received)
    if missing:
        raise SystemExit(f"{variant.name}: {len(missing)} events never arrived")
    latencies = [max(0.0, received[p] - at) for p, at in appended.items()]
    variant.latencies += latencies
    variant.round_p50.append(percentile(latencies, 0.5))


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.arguments("Tail latency behind a transaction-mode pooler.")
    parser.add_argument("--seconds", type=float, help="seconds per round (10)")
    args = bench.parse(parser, argv)
    seconds = bench.sized(args, "seconds", 2.0, 10.0)
    with bench.benchmark_database(bench.dsn_of(args), "bench_pooler_", migrate=True) as database:
        with subengine.Engine(database.dsn, schema=bench.SCHEMA) as engine:
            engine.create_stream(STREAM, 1)
        with pgbouncer(database.dsn) as through:
            base = subengine.Settings.from_env(schema=bench.SCHEMA)
            variants = [
                Variant("direct (push)", base.with_changes(dsn=database.dsn)),
                Variant(
                    "pooler + direct DSN (push)",
                    base.with_changes(dsn=through, direct_dsn=database.dsn),
                ),
                Variant(
                    "pooler, poll-only, poll 1 s",
                    base.with_changes(dsn=through, poll_interval=1.0),
                ),
                Variant(
                    "pooler, poll-only, poll 5 s (default)",
                    base.with_changes(dsn=through, poll_interval=5.0),
                ),
            ]
            for number, variant in bench.rotating(variants, args.rounds):
                one_round(variant, seconds)
                progress(f"round {number + 1}: {variant.name}")
    print()
    print(
        f"{RATE:g} events/s, 1 event per append, {args.rounds} rounds of {seconds:g} s in "
        "rotating order; from the append's return to the tail's event, ms"
    )
    header = (
        f"{'variant':<40} {'events':>7} {'p50':>9} {'p99':>9} {'max':>9}"
        "   round p50s: median (min, max)"
    )
    print(header)
    print("-" * len(header))
    direct = percentile(variants[0].latencies, 0.5)
    for variant in variants:
        p50, p99 = (percentile(variant.latencies, f) * 1000 for f in (0.5, 0.99))
        rounds = sorted(p * 1000 for p in variant.round_p50)
        print(
            f"{variant.name:<40} {len(variant.latencies):>7} {p50:>9.2f} {p99:>9.2f} "
            f"{max(variant.latencies) * 1000:>9.2f}   {rounds[len(rounds) // 2]:.2f} "
            f"({rounds[0]:.2f}, {rounds[-1]:.2f})"
        )
    print()
    for variant in variants[1:]:
        ratio = percentile(variant.latencies, 0.5) / direct if direct else float("inf")
        print(f"p50 {variant.name} / direct: {ratio:,.1f}  (the issue sets no goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
