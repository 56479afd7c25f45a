"""What a Durable Streams fork inherits and how its offsets and floor follow from that
(docs/durable-streams.md, "Forks"), without a database: the catalog's rows as the
gateway reads them."""

from __future__ import annotations

from typing import Any

from subengine.outside._durable_streams import CatalogStream, Inherited, _stream


def row(
    stream: str,
    epoch: int,
    tail: int,
    *,
    floor: int = 1,
    fork_point: int | None = None,
    ranges: tuple[Inherited, ...] = (),
) -> tuple[Any, ...]:
    """A row of the query ds_stream."""
    catalog = ("/" + stream, stream, "text/plain", None, None, None, tail, False)
    state = (None, None, None, None, epoch, floor, False)
    fork = (False, "parent" if ranges else None, None, None, None, fork_point)
    inherited = tuple(
        [getattr(part, name) for part in ranges] or None
        for name in ("stream", "epoch", "after", "upto", "cut", "floor")
    )
    return catalog + state + fork + inherited


def test_a_fork_of_a_fork_inherits_the_ranges_its_source_reads_up_to_its_fork_point() -> None:
    root = _stream(row("a", 1, 5))
    b = _stream(row("b", 2, 8, fork_point=3, ranges=root.inherit(3, None)))
    assert b.inherited == (Inherited("a", 1, 0, 3),)
    # past b's fork point: b's own messages 4 and 5 too; at it: a's only
    assert b.inherit(5, None) == (Inherited("a", 1, 0, 3), Inherited("b", 2, 3, 5))
    assert b.inherit(3, None) == (Inherited("a", 1, 0, 3),)
    assert b.inherit(0, None) == ()


def test_cuts_compose_down_a_chain_of_forks() -> None:
    # a's message 1 is "abcdef": b keeps 4 bytes of it, c 2 of b's 4
    b = _stream(row("b", 2, 1, fork_point=1, ranges=(Inherited("a", 1, 0, 1, 4),)))
    assert b.holder(1) == ("a", 4)
    assert b.inherit(1, None) == (Inherited("a", 1, 0, 1, 4),)
    assert b.inherit(1, 2) == (Inherited("a", 1, 0, 1, 2),)
    assert b.holder(2) == ("b", None)


def test_a_forks_offsets_are_its_sources_up_to_the_fork_point() -> None:
    fork = _stream(row("b", 7, 6, fork_point=3, ranges=(Inherited("a", 2, 0, 3),)))
    assert [fork.epoch_at(p) for p in (0, 3, 4, 6)] == [2, 2, 7, 7]
    assert fork.check_offset(2, 3) == "ok"
    assert fork.check_offset(2, 4) == "foreign"  # the source's, past the fork point
    assert fork.check_offset(7, 5) == "ok"
    assert fork.check_offset(7, 2) == "foreign"
    assert fork.check_offset(7, 7) == "beyond"
    assert fork.check_offset(5, 1) == "gone"  # an earlier incarnation of the path
    assert fork.check_offset(0, 0) == "ok"
    assert fork.offset_at(3) == "0000000000000002_0000000000000003"


def test_a_forks_floor_is_past_the_last_range_retention_cut_into() -> None:
    def floor(own: int, *ranges: Inherited) -> int:
        found: CatalogStream = _stream(row("c", 9, 20, floor=own, fork_point=10, ranges=ranges))
        return found.floor

    a, b = Inherited("a", 1, 0, 4), Inherited("b", 2, 4, 10)
    assert floor(11, a, b) == 1
    assert floor(11, Inherited("a", 1, 0, 4, floor=3), b) == 3  # pruned before the fork
    assert floor(11, a, Inherited("b", 2, 4, 10, floor=7)) == 7
    assert floor(11, a, Inherited("b", 2, 4, 10, floor=30)) == 11  # all of b's range
    assert floor(11, a, Inherited("b", None, 4, 10)) == 11  # b's engine stream is gone
    assert floor(15, a, b) == 15  # the fork's own retention cut past the fork point
