from hypothesis import given
from hypothesis import strategies as st

import pytest

from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.request import Request


def test_capacity_rounds_down_to_blocks():
    pool = BlockPool(100, 16)
    assert pool.num_blocks == 6 and pool.capacity_tokens == 96


def test_rejects_capacity_below_one_block():
    with pytest.raises(ValueError, match="smaller than one block"):
        BlockPool(8, 16)


def test_grow_is_all_or_nothing():
    pool = BlockPool(64, 16)
    a, b = Request("a", 0, 1, 1), Request("b", 0, 1, 1)
    assert pool.grow(a, 40)  # 3 blocks
    assert not pool.grow(b, 20)  # needs 2, 1 free
    assert b.block_ids == [] and pool.num_free_blocks == 1
    pool.free(a)
    assert pool.num_free_blocks == 4


ops = st.lists(st.tuples(st.sampled_from(["grow", "free", "add_one"]), st.integers(0, 7), st.integers(1, 200)),
               max_size=200)


@given(ops, st.sampled_from([1, 4, 16]), st.integers(16, 600))
def test_blocks_are_conserved(ops, block_size, capacity):
    pool = BlockPool(max(capacity, block_size), block_size)
    reqs = [Request(str(i), 0, 1, 1) for i in range(8)]
    for op, i, n in ops:
        r = reqs[i]
        before = len(r.block_ids)
        if op == "grow":
            ok = pool.grow(r, n)
            if ok:
                assert len(r.block_ids) * block_size >= n
            else:
                assert len(r.block_ids) == before
        elif op == "add_one":
            some = reqs[:1 + n % 8]
            if len(some) <= pool.num_free_blocks:
                pool.add_one_block(some)
        else:
            pool.free(r)
        held = [b for q in reqs for b in q.block_ids]
        assert len(held) == len(set(held)), "a block is held twice"
        assert len(held) + pool.num_free_blocks == pool.num_blocks
        assert pool.used_tokens == len(held) * block_size <= pool.capacity_tokens
