"""How subengine's worker scales to 1,024 partitions and 100 subscriptions (issue 12): the
look for work and the idle worker's poll, a fan-out at 8 and 1,024 partitions at two
densities (a backlog of ~20 events per partition, and a sparse one of ~2: issue 28), the
latency from an append's commit to its handler, an idle worker's statements, and a fresh
database growing without statistics. The README's performance section explains each.

    .venv/bin/python bench/scale.py            # about 12 minutes on 2 cores
    .venv/bin/python bench/scale.py --quick    # about 2 minutes, for a smoke test
    .venv/bin/python bench/scale.py --fanout-only   # the fan-outs alone
    .venv/bin/python bench/scale.py --dsn postgresql://...   # or set SUBENGINE_DSN

Every run creates databases of its own (`bench_scale_<pid>`, and `..._fresh<n>` for the
fresh database) and drops them at the end. Every load is bounded in count and in time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import SpawnContext
from typing import TYPE_CHECKING, Any

import _harness as bench
import _workers as workers
import psycopg
from _harness import SCHEMA, Database, Spread, progress
from _scale import (
    Config,
    FanoutRun,
    FreshStep,
    Looker,
    fanout_stream,
    fresh_round,
    partition_keys,
    print_fanout,
    print_fresh,
    run_fanout,
)
from _workers import StartPoint, WorkerJob

if TYPE_CHECKING:
    import subengine

DATABASE_PREFIX = "bench_scale_"
SMALL_PARTITIONS = 8
APPEND_BATCH = 100
# Goals of issue 12.
LOOK_GOAL_MS = 5.0
IDLE_LOOK_GOAL_MS = 1.0
FANOUT_GOAL = 0.5
LATENCY_P50_GOAL_MS = 1.5
LATENCY_P99_GOAL_MS = 8.0
IDLE_GOAL = 0.2
FRESH_APPEND_GOAL = 0.5


class Results:
    """Every round's figures, by variant (looks and latencies: seconds, a list per round;
    fan-out: runs by partitions and events per subscription; idle: statements/s by
    concurrency)."""

    def __init__(self) -> None:
        table = collections.defaultdict
        self.looks: dict[str, list[list[float]]] = table(list)
        self.found: dict[str, set[int]] = table(set)
        self.fanout: dict[tuple[int, int], list[FanoutRun]] = table(list)
        self.latency: dict[str, list[list[float]]] = table(list)
        self.idle: dict[int, list[float]] = table(list)
        self.idle_kinds: dict[int, collections.Counter[str]] = table(collections.Counter)
        self.fresh: list[list[FreshStep]] = []


# the benchmark's streams and subscriptions


def look_names(variant: str, count: int) -> list[str]:
    return [f"look-{variant}-{n:03d}" for n in range(count)]


def fill(engine: subengine.Engine, stream: str, partitions: int, events: int, seed: int) -> float:
    """Append `events` events spread evenly over every partition, in batches of
    APPEND_BATCH; the events per second."""
    rng = random.Random(seed)
    keys = partition_keys(partitions, stream)
    order = list(range(partitions))
    rng.shuffle(order)
    seconds = bench.append_orders(
        engine, stream, events, rng, lambda n: keys[order[n % partitions]], APPEND_BATCH
    )
    return events / max(seconds, 1e-9)


def prepare(database: Database, config: Config) -> None:
    """The look streams and their subscriptions, and the fan-out and live streams."""
    import subengine

    with subengine.Engine(database.dsn, schema=SCHEMA) as engine:
        engine.migrate()
        looked = () if config.fanout_only else ("small", "large", "idle")
        for variant, per_partition in (
            ("small", config.backlog_small),
            ("large", config.backlog_large),
            ("idle", config.backlog_small),
        ):
            if variant not in looked:
                continue
            stream = f"look-{variant}"
            engine.create_stream(stream, config.partitions)
            rate = fill(
                engine, stream, config.partitions, per_partition * config.partitions, config.seed
            )
            start: StartPoint = "end" if variant == "idle" else "beginning"
            names = look_names(variant, config.subscriptions)
            workers.ensure_subscriptions(database.dsn, names, stream, start)
            progress(
                f"stream {stream}: {per_partition * config.partitions:,} events "
                f"({rate:,.0f} events/s), {config.subscriptions} subscriptions at the {start}"
            )
        for partitions in sorted({SMALL_PARTITIONS, config.partitions}):
            for events in (config.fanout_events, config.sparse_events):
                stream = fanout_stream(partitions, events, config)
                engine.create_stream(stream, partitions)
                fill(engine, stream, partitions, events, config.seed + 1)
            engine.create_stream(f"live-{partitions}", partitions)
        progress(
            f"fan-out streams: {config.fanout_events:,} events each, sparse "
            f"{config.sparse_events:,}"
        )
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


# latency and idle statements


def run_latency(
    context: SpawnContext, database: Database, config: Config, partitions: int, name: str,
    round_: int,
) -> list[float]:  # fmt: skip
    """Seconds from each measured event's commit to its handler's start."""
    stream = f"live-{partitions}"
    subscription = f"lat-{name}-r{round_}"
    workers.ensure_subscriptions(database.dsn, [subscription], stream, "end")
    return workers.live_latency(
        context, database.dsn, stream, subscription,
        (config.latency_warmup, config.latency_events), config.latency_rate,
        config.seed + round_, config.batch_size,
    ).samples  # fmt: skip


def run_idle(
    context: SpawnContext, database: Database, config: Config
) -> dict[int, tuple[float, collections.Counter[str]]]:
    """Statements/s of an idle worker at concurrency 1 and 4, run side by side."""
    names = tuple(look_names("idle", config.subscriptions))
    concurrencies = (1, 4)
    jobs = [
        WorkerJob(database.dsn, names, "look-idle", "end", "no-op", config.batch_size, c)
        for c in concurrencies
    ]
    counted = workers.idle_statements(
        context, jobs, config.idle_skip + config.idle_seconds, config.idle_skip
    )
    return dict(zip(concurrencies, counted, strict=True))


# the report


def ms(seconds: float) -> float:
    return seconds * 1000


def goal_line(label: str, value: str, goal: str, ok: bool | None) -> None:
    judged = "" if ok is None else bench.verdict(ok)
    print(f"  {label:<52} {value:>10}  {goal:<22} {judged}")


def print_report(results: Results, config: Config) -> None:
    look_median = {} if config.fanout_only else print_looks(results, config)
    print(
        f"fan-out: effects/s of {config.subscriptions} subscriptions x N events, "
        f"{config.processes} worker processes, {config.window:g} s windows after "
        f"{config.warmup:g} s; CPU s per run and load: median (min-max)"
    )
    ratios = print_fanout(results.fanout, SMALL_PARTITIONS, config.partitions)
    print()
    if config.fanout_only:
        print("goals (medians over the rounds)")
        fanout_goals(ratios, config)
        return
    print_rest(results, config, look_median, ratios)


def fanout_goals(ratios: dict[int, float], config: Config) -> None:
    for events, ratio in sorted(ratios.items(), reverse=True):
        goal_line(
            f"fan-out, {config.partitions} / {SMALL_PARTITIONS}, {events:,} events (effects/s)",
            f"{ratio:.4f}", f">= {FANOUT_GOAL:g}", ratio >= FANOUT_GOAL,
        )  # fmt: skip


def print_looks(results: Results, config: Config) -> dict[str, float]:
    print("partition choice: ms per look (median, min, max over every look of every round)")
    look_median: dict[str, float] = {}
    labels = {
        "small": f"work everywhere, backlog S ({config.backlog_small}/partition)",
        "large": f"work everywhere, backlog L ({config.backlog_large}/partition)",
        "idle": "nothing to do",
        "poll": "nothing to do: the idle worker's poll",
    }
    for variant, label in labels.items():
        rounds = results.looks[variant]
        pooled = [ms(t) for times in rounds for t in times]
        spread = Spread.of(pooled)
        look_median[variant] = spread.median
        round_medians = ", ".join(f"{statistics.median(times) * 1000:.2f}" for times in rounds)
        found = ",".join(str(n) for n in sorted(results.found[variant]))
        print(f"  {label:<40} {spread.text(2, ' ms', count=True)}")
        print(f"  {'':<40} round medians {round_medians}; candidates found {found}")
    print(f"  backlog L / backlog S: {look_median['large'] / look_median['small']:.2f}")
    print()
    return look_median


def print_rest(
    results: Results, config: Config, look_median: dict[str, float], ratios: dict[int, float]
) -> None:
    print(
        f"latency: append commit -> handler start, ms, {config.latency_events:,} events per "
        f"round after {config.latency_warmup} warm-up, at {config.latency_rate:g} events/s"
    )
    latency_figures: dict[str, tuple[float, float]] = {}
    for variant, rounds in results.latency.items():
        p50s = [ms(bench.percentile(r, 0.5)) for r in rounds]
        p99s = [ms(bench.percentile(r, 0.99)) for r in rounds]
        pooled = [ms(s) for r in rounds for s in r]
        latency_figures[variant] = (statistics.median(p50s), statistics.median(p99s))
        print(
            f"  {variant:<17} p50 {Spread.of(p50s).text(2, count=True)}"
            f"   p99 {Spread.of(p99s).text(2, count=True)}"
            f"   all rounds: p50 {bench.percentile(pooled, 0.5):.2f}, p99 "
            f"{bench.percentile(pooled, 0.99):.2f}, max {max(pooled):.2f}"
        )
    print()
    print(
        f"idle worker statements/s ({config.subscriptions} subscriptions with nothing to do, "
        f"{config.partitions} partitions; {config.idle_seconds:g} s after {config.idle_skip:g} s)"
    )
    for concurrency, rates in sorted(results.idle.items()):
        kinds = results.idle_kinds[concurrency]
        total = sum(kinds.values())
        top = "; ".join(f"{n} x {kind}" for kind, n in kinds.most_common(4))
        print(f"  concurrency {concurrency}: {Spread.of(rates).text(3, count=True)}")
        print(f"    {total} statements over the rounds: {top}")
    print()
    fresh_goals = print_fresh(results.fresh)
    print()
    print("goals (medians over the rounds)")
    goal_line(
        "choice, work everywhere, backlog S (ms/look)", f"{look_median['small']:.2f}",
        f"<= {LOOK_GOAL_MS:g}", look_median["small"] <= LOOK_GOAL_MS,
    )  # fmt: skip
    goal_line(
        "choice, work everywhere, backlog L (ms/look)", f"{look_median['large']:.2f}",
        f"<= {LOOK_GOAL_MS:g}", look_median["large"] <= LOOK_GOAL_MS,
    )  # fmt: skip
    flat = look_median["large"] / look_median["small"]
    goal_line("choice, backlog L / backlog S", f"{flat:.2f}", "flat (~1)", None)
    goal_line("choice, nothing to do (ms/look)", f"{look_median['idle']:.2f}", "-", None)
    goal_line(
        "nothing to do: the idle worker's poll (ms/poll)", f"{look_median['poll']:.2f}",
        f"<= {IDLE_LOOK_GOAL_MS:g}", look_median["poll"] <= IDLE_LOOK_GOAL_MS,
    )  # fmt: skip
    fanout_goals(ratios, config)
    for variant, (p50, p99) in latency_figures.items():
        goal_line(
            f"latency p50, {variant} (ms)", f"{p50:.2f}", f"<= {LATENCY_P50_GOAL_MS:g}",
            p50 <= LATENCY_P50_GOAL_MS,
        )  # fmt: skip
        goal_line(
            f"latency p99, {variant} (ms)", f"{p99:.2f}", f"<= {LATENCY_P99_GOAL_MS:g}",
            p99 <= LATENCY_P99_GOAL_MS,
        )  # fmt: skip
    for concurrency, rates in sorted(results.idle.items()):
        rate = statistics.median(rates)
        goal_line(
            f"idle worker, concurrency {concurrency} (statements/s)", f"{rate:.3f}",
            f"<= {IDLE_GOAL:g}", rate <= IDLE_GOAL,
        )  # fmt: skip
    worst_look, worst_singles, worst_batch = fresh_goals
    goal_line(
        "fresh database: worst step's choice (ms/look)", f"{worst_look:.2f}",
        f"<= {LOOK_GOAL_MS:g}", worst_look <= LOOK_GOAL_MS,
    )  # fmt: skip
    goal_line(
        "fresh database: worst single appends / analysed", f"{worst_singles:.2f}",
        f">= {FRESH_APPEND_GOAL:g}", worst_singles >= FRESH_APPEND_GOAL,
    )  # fmt: skip
    goal_line(
        "fresh database: worst batch appends / analysed", f"{worst_batch:.2f}",
        f">= {FRESH_APPEND_GOAL:g}", worst_batch >= FRESH_APPEND_GOAL,
    )  # fmt: skip


# the run


def parse_args(argv: Sequence[str] | None) -> tuple[Any, Config]:
    parser = bench.arguments(
        "Measure the worker at 1,024 partitions and 100 subscriptions (issue 12)."
    )
    add = parser.add_argument
    add("--partitions", type=int, default=1024, help="partitions of the large streams (1024)")
    add("--subscriptions", type=int, default=100, help="subscriptions per worker (100)")
    add("--backlog-small", type=int, help="events per partition, backlog S (5)")
    add("--backlog-large", type=int, help="events per partition, backlog L (100)")
    add("--looks", type=int, help="looks per variant and round, at most (50)")
    add("--look-seconds", type=float, help="seconds of looks per variant and round (6)")
    add("--fanout-events", type=int, default=20_000, help="events of the fan-out (20000)")
    add("--sparse-events", type=int, help="events of the sparse fan-out (2000)")
    add("--fanout-only", action="store_true", help="measure the fan-outs alone")
    add("--processes", type=int, default=2, help="worker processes of the fan-out (2)")
    add("--batch-size", type=int, default=100, help="events per batch (100)")
    add("--window", type=float, help="seconds of a fan-out rate window (20)")
    add("--warmup", type=float, help="seconds before a fan-out window opens (3)")
    add("--latency-events", type=int, help="measured live events per round (1000)")
    add("--latency-rate", type=float, default=200.0, help="live events/s (200)")
    add("--idle-seconds", type=float, help="measured idle seconds per round (20)")
    add("--fresh-events", type=int, help="events the fresh database grows to (65536)")
    add("--seed", type=int, default=20261122, help="seed of the event data")
    args = bench.parse(parser, argv)
    quick = args.quick
    if args.sparse_events is not None and args.sparse_events == args.fanout_events:
        parser.error("--sparse-events must differ from --fanout-events")

    def chosen(name: str, quick: Any, default: Any) -> Any:
        return bench.sized(args, name, quick, default)

    config = Config(
        partitions=args.partitions,
        subscriptions=args.subscriptions,
        rounds=args.rounds,
        backlog_small=chosen("backlog_small", 2, 5),
        backlog_large=chosen("backlog_large", 10, 100),
        looks=chosen("looks", 10, 50),
        look_seconds=chosen("look_seconds", 1.0, 6.0),
        fanout_events=args.fanout_events if not quick else min(args.fanout_events, 2_000),
        sparse_events=chosen("sparse_events", 200, 2_000),
        fanout_only=args.fanout_only,
        processes=args.processes,
        batch_size=args.batch_size,
        window=chosen("window", 3.0, 20.0),
        warmup=chosen("warmup", 1.0, 3.0),
        latency_events=chosen("latency_events", 100, 1_000),
        latency_warmup=20 if quick else 100,
        latency_rate=args.latency_rate,
        idle_seconds=chosen("idle_seconds", 6.0, 20.0),
        idle_skip=2.0 if quick else 5.0,
        fresh_early=256 if quick else 1024,
        fresh_events=chosen("fresh_events", 4096, 65_536),
        fresh_singles=30 if quick else 100,
        seed=args.seed,
    )
    return args, config


def run_rounds(context: SpawnContext, database: Database, config: Config, results: Results) -> None:
    import subengine

    large = config.partitions
    with (
        subengine.Engine(database.dsn, schema=SCHEMA) as engine,
        contextlib.ExitStack() as stack,
    ):
        by_variant = {
            v: stack.enter_context(
                Looker.open(engine, look_names(v, config.subscriptions), f"look-{v}")
            )
            for v in ("small", "large", "idle")
            if not config.fanout_only
        }
        if not config.fanout_only:
            by_variant["poll"] = stack.enter_context(
                Looker.open(engine, look_names("idle", config.subscriptions), "look-idle", True)
            )

        def looks(variant: str) -> Callable[[int], None]:
            def run(round_: int) -> None:
                times, found = by_variant[variant].looks(config.looks, config.look_seconds)
                results.looks[variant].append(times)
                results.found[variant].add(found)
                progress(
                    f"round {round_}: look, {variant}: {statistics.median(times) * 1000:.2f} "
                    f"ms median of {len(times)}"
                )

            return run

        def fanout(partitions: int, events: int, then_latency: bool) -> Callable[[int], None]:
            def run(round_: int) -> None:
                ran = run_fanout(context, database, config, partitions, events, round_)
                results.fanout[partitions, events].append(ran)
                progress(
                    f"round {round_}: fan-out, {partitions} partitions x {events:,} events: "
                    f"{ran.rate:,.0f} effects/s; CPU s: workers {ran.worker_cpu:.1f}, server "
                    f"{'-' if ran.server_cpu is None else f'{ran.server_cpu:.1f}'}; load "
                    f"{ran.load:.1f}"
                )
                if then_latency and not config.fanout_only:
                    latency(large, f"{large} after load")(round_)

            return run

        def latency(partitions: int, variant: str) -> Callable[[int], None]:
            def run(round_: int) -> None:
                name = variant.replace(" ", "-")
                samples = run_latency(context, database, config, partitions, name, round_)
                results.latency[variant].append(samples)
                progress(
                    f"round {round_}: latency, {variant}: p50 "
                    f"{bench.percentile(samples, 0.5) * 1000:.2f} ms, p99 "
                    f"{bench.percentile(samples, 0.99) * 1000:.2f} ms"
                )

            return run

        def idle(round_: int) -> None:
            for concurrency, (rate, kinds) in run_idle(context, database, config).items():
                results.idle[concurrency].append(rate)
                results.idle_kinds[concurrency].update(kinds)
                progress(
                    f"round {round_}: idle, concurrency {concurrency}: {rate:.3f} statements/s"
                )

        dense, sparse = config.fanout_events, config.sparse_events
        fanouts = [
            fanout(SMALL_PARTITIONS, dense, False),
            fanout(large, dense, True),  # then the latency at 1,024 right after it
            fanout(SMALL_PARTITIONS, sparse, False),
            fanout(large, sparse, False),
        ]
        variants: list[Callable[[int], None]] = fanouts if config.fanout_only else [
            looks("small"),
            looks("large"),
            looks("idle"),
            looks("poll"),
            *fanouts,
            latency(SMALL_PARTITIONS, f"{SMALL_PARTITIONS}"),
            latency(large, f"{large}"),
            idle,
        ]  # fmt: skip
        # the after-load latency is reported after the plain ones
        results.latency[f"{SMALL_PARTITIONS}"] = []
        results.latency[f"{large}"] = []
        for round_, variant in bench.rotating(variants, config.rounds):
            variant(round_)


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    import subengine

    context = multiprocessing.get_context("spawn")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    results = Results()
    with bench.benchmark_database(bench.dsn_of(args), DATABASE_PREFIX) as database:
        prepare(database, config)
        run_rounds(context, database, config, results)
        for round_ in range(0 if config.fanout_only else config.rounds):
            results.fresh.append(fresh_round(database.admin_dsn, config, round_, DATABASE_PREFIX))
            progress(f"round {round_}: fresh database measured")
        facts = bench.server_facts(database.dsn)
    settings = subengine.Settings.from_env()
    print()
    print(f"{bench.machine(facts, load_before)}; {time.monotonic() - started:.0f} s")
    print(
        f"worker settings: poll_interval {settings.poll_interval:g} s, heartbeat_interval "
        f"{settings.heartbeat_interval:g} s, progress_interval "
        f"{settings.progress_interval:g} s; batch size {config.batch_size}"
    )
    print(
        "run settings: "
        + ", ".join(f"{f.name} {getattr(config, f.name)}" for f in dataclasses.fields(config))
        + (" (--quick)" if args.quick else "")
    )
    print()
    print_report(results, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
