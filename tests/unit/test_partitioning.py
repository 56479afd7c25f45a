"""The partition of a key: stable across versions and processes."""

from __future__ import annotations

import subengine


def test_partition_function_is_stable() -> None:
    # Changing the function would move existing keys to other partitions.
    keys = ("a", "b", "order-1", "order-2", "order-3")
    assert [subengine.partition_for(k, 8) for k in keys] == PINNED_8
    assert [subengine.partition_for(k, 1000) for k in keys] == PINNED_1000


# partition_for of "a", "b", "order-1", "order-2", "order-3" (MD5 prefix; see its docstring)
PINNED_8 = [0, 4, 5, 2, 3]


PINNED_1000 = [800, 124, 349, 698, 635]
