"""The board of suspects and the wake-up a worker's slots share (subengine.worker._board):
which notified partitions a slot takes without a look, and which wake-ups ask every slot
to look."""

from __future__ import annotations

import threading

from subengine import Subscription
from subengine.worker._board import Board, Wakeup


def board() -> Board:
    found = Board([Subscription("billing", "orders"), Subscription("audit", "orders")])
    for partition in range(4):
        assert found.grew("orders", partition, 1)
    return found


def test_a_slot_takes_its_own_partition_first_and_none_another_slot_holds() -> None:
    suspects = board()
    others = {("billing", 0), ("audit", 1)}
    taken = suspects.take_few(3, mine=("audit", 3), others=others)
    assert taken == [("audit", 3), ("audit", 0), ("audit", 2)]
    assert suspects.pending_for(others)  # ("billing", 1) and others are left
    rest = suspects.take_few(10, others=others)
    assert ("billing", 0) not in rest and ("audit", 1) not in rest
    # what is left is for the slots that hold those partitions
    assert not suspects.pending_for(others)
    assert suspects.pending()
    assert suspects.take_few(10, mine=("billing", 0), others={("audit", 1)}) == [("billing", 0)]
    assert suspects.take_few(10, mine=("audit", 1)) == [("audit", 1)]
    assert not suspects.pending()


def test_a_look_leaves_the_partitions_other_slots_hold_for_them() -> None:
    # a look could not lock them, and would leave their holder waiting for a poll
    suspects = board()
    pairs, whole = suspects.take(others={("billing", 0)})
    assert ("billing", 0) not in pairs and len(pairs) == 7 and whole == []
    assert not suspects.pending_for({("billing", 0)})
    assert suspects.take_few(4, mine=("billing", 0)) == [("billing", 0)]


def test_whole_subscriptions_are_for_a_look_only() -> None:
    suspects = board()
    suspects.heads_read([("orders", 0, 1)], everything=True)
    assert suspects.take_few(4) == []
    assert suspects.pending_for({("billing", 0)})


def test_only_some_wake_ups_ask_every_slot_to_look() -> None:
    wakeup = Wakeup()
    count, looks = wakeup.count(), wakeup.looks()
    wakeup.notify(look=False)  # an append's notification: its suspects are for who takes them
    assert (wakeup.count(), wakeup.looks()) == (count + 1, looks)
    wakeup.notify()  # a poll that found work, a reconnection, a stop
    assert (wakeup.count(), wakeup.looks()) == (count + 2, looks + 1)
    woken = threading.Event()

    def waiting() -> None:
        if wakeup.wait(count + 2, 30):
            woken.set()

    thread = threading.Thread(target=waiting)
    thread.start()
    wakeup.notify(look=False)
    thread.join(30)
    assert woken.is_set()
