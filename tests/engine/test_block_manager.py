"""BlockManager: blocks are handed out on demand, grow with a sequence, come back on free, are
reused, and running out leaves everything untouched so the scheduler can make the request wait."""

import pytest

from moebench.engine.kv_cache import BlockManager, OutOfBlocks


def test_allocation_rounds_up_to_whole_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    bm.ensure_capacity(table, 1)
    assert len(table) == 1 and bm.num_free == 7
    bm.ensure_capacity(table, 4)  # still fits the first block
    assert len(table) == 1
    bm.ensure_capacity(table, 9)
    assert len(table) == 3 and bm.num_free == 5 and bm.num_used == 3
    assert len(set(table)) == 3


def test_growth_one_token_at_a_time_adds_a_block_at_each_boundary():
    bm = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    sizes = []
    for n in range(1, 14):
        bm.ensure_capacity(table, n)
        sizes.append(len(table))
    assert sizes == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert bm.missing_blocks(table, 16) == 0 and bm.missing_blocks(table, 17) == 1


def test_sequences_never_share_a_block():
    bm = BlockManager(num_blocks=12, block_size=2)
    tables = [[] for _ in range(3)]
    for n in range(1, 9):
        for t in tables:
            bm.ensure_capacity(t, n)
    owned = [b for t in tables for b in t]
    assert len(owned) == len(set(owned)) == 12


def test_free_returns_blocks_and_they_are_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a: list[int] = []
    bm.ensure_capacity(a, 16)
    first = list(a)
    assert bm.num_free == 0
    bm.free(a)
    assert a == [] and bm.num_free == 4
    b: list[int] = []
    bm.ensure_capacity(b, 8)
    assert set(b) <= set(first)
    assert bm.reuses == 2 and bm.allocations == 6 and bm.peak_used == 4


def test_out_of_blocks_is_back_pressure_not_corruption():
    bm = BlockManager(num_blocks=3, block_size=4)
    a: list[int] = []
    bm.ensure_capacity(a, 8)
    b: list[int] = []
    assert not bm.can_fit(b, 8)
    with pytest.raises(OutOfBlocks):
        bm.ensure_capacity(b, 8)
    assert b == [] and bm.num_free == 1  # nothing half-allocated
    assert bm.can_fit(b, 4) and not bm.can_fit(b, 4, reserve=1)
    bm.free(a)
    bm.ensure_capacity(b, 8)  # once blocks come back, the waiting request fits
    assert len(b) == 2


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=4)
    a: list[int] = []
    bm.ensure_capacity(a, 4)
    stale = list(a)
    bm.free(a)
    with pytest.raises(ValueError):
        bm.free(stale)
    assert bm.num_free == 2
