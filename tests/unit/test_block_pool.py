"""BlockPool and block hashing: exact block ids, ref counts and eviction order."""

from __future__ import annotations

from asyncllm.kv.block_pool import BlockPool
from asyncllm.kv.hashing import ROOT_PARENT_HASH, block_extra_keys, extend_block_hashes, hash_block_tokens


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0
    assert pool.free_block_ids() == [0, 1, 2, 3]


def test_allocate_takes_from_the_front_and_counts_usage():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert _ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75
    assert pool.can_allocate(1) and not pool.can_allocate(2)


def test_uncached_freed_blocks_go_to_the_front():
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    pool.free([b1, b0])
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert (b0.ref_cnt, b1.ref_cnt) == (0, 0)


def test_cached_freed_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = [bytes([i]) * 32 for i in range(3)]
    for block, block_hash in zip(blocks, hashes):
        assert pool.cache_block(block, block_hash, [block.block_id] * 4)
    pool.free(reversed(blocks))
    # the uncached block 3 goes first, then the cached ones in the order they were freed
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert _ids(pool.allocate(2)) == [3, 2]
    assert pool.get_cached_block(hashes[2], [2] * 4) is None  # evicted on reuse
    assert pool.get_cached_block(hashes[1], [1] * 4) is blocks[1]
    assert pool.num_cached_blocks == 2
    assert blocks[2].block_hash is None and blocks[2].token_ids is None


def test_touch_revives_a_free_cached_block_and_counts_references():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h" * 32, [5, 6])
    pool.free([block])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.free_block_ids() == [1, 2]
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([block])
    assert pool.free_block_ids() == [1, 2, 0]
    assert block.block_hash == b"h" * 32  # still cached while free


def test_a_hit_rechecks_the_tokens():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"x" * 32, [1, 2, 3])
    assert pool.get_cached_block(b"x" * 32, [1, 2, 3]) is block
    assert pool.get_cached_block(b"x" * 32, [1, 2, 4]) is None
    assert pool.get_cached_block(b"y" * 32, [1, 2, 3]) is None


def test_a_second_block_with_a_known_hash_stays_uncached():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, b"x" * 32, [1])
    assert not pool.cache_block(second, b"x" * 32, [1])
    assert second.block_hash is None
    pool.free([first, second])
    assert pool.free_block_ids() == [1, 0]  # the duplicate is reused before the cached block


def test_block_hash_chains_parent_tokens_and_extra_keys():
    h0 = hash_block_tokens(ROOT_PARENT_HASH, [1, 2, 3, 4])
    assert len(h0) == 32
    assert h0 == hash_block_tokens(ROOT_PARENT_HASH, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(ROOT_PARENT_HASH, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(ROOT_PARENT_HASH, [1, 2, 3, 4], ("salt", "a"))
    assert hash_block_tokens(h0, [9]) != hash_block_tokens(ROOT_PARENT_HASH, [9])


def test_cache_salt_goes_into_the_first_block_only():
    assert block_extra_keys(0, "s") == ("salt", "s")
    assert block_extra_keys(1, "s") == ()
    assert block_extra_keys(0, None) == ()


def test_extend_block_hashes_is_incremental_and_only_hashes_full_blocks():
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4, 1, None)
    assert hashes == [hash_block_tokens(ROOT_PARENT_HASH, [0, 1, 2, 3])]
    extend_block_hashes(hashes, tokens, 4, 5, None)  # only 2 blocks of 10 tokens are full
    assert hashes == [hashes[0], hash_block_tokens(hashes[0], [4, 5, 6, 7])]
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, 4, 2, "s")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]


def test_allocate_one_is_allocate_of_one_block():
    """The decode hot path: the front block, its stale cache entry evicted, None once the pool is empty."""
    pool = BlockPool(2)
    b0 = pool.allocate(1)[0]
    digest = hash_block_tokens(ROOT_PARENT_HASH, [1, 2])
    pool.cache_block(b0, digest, [1, 2])
    pool.free([b0])  # cached: joins the back, after block 1
    assert pool.allocate_one().block_id == 1
    again = pool.allocate_one()
    assert again is b0 and again.ref_cnt == 1 and again.block_hash is None
    assert pool.get_cached_block(digest, [1, 2]) is None  # evicted when handed out
    assert pool.allocate_one() is None and pool.num_free_blocks == 0
