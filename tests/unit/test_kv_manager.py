"""KVCacheManager: block tables, prefix hits, eviction, counters (exact block ids)."""

from __future__ import annotations

from asyncllm.kv.manager import KVCacheManager
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request


def _request(req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(), [0], 0.0, cache_salt=cache_salt)


def _admit_and_compute(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` with its prefix hits, compute all its tokens and cache them; its block ids."""
    hits, num_hit = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert ids is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return ids


def _ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_second_identical_prompt_hits_all_full_blocks_but_the_last_token():
    kv = KVCacheManager(num_gpu_blocks=64, block_size=16, enable_prefix_caching=True)
    prompt = list(range(1000, 1600))  # 600 tokens: 37 full blocks + 8 tokens
    first = _request("a", prompt)
    assert _admit_and_compute(kv, first) == list(range(38))
    second = _request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 592
    assert [b.block_id for b in hits] == list(range(37))
    assert kv.allocate_slots(second, 600 - 592, hits) == list(range(37)) + [38]
    assert _ref_cnts(kv)[:39] == [2] * 37 + [1, 1]
    assert kv.num_used_blocks == 39
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (1200, 592)


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    kv = KVCacheManager(num_gpu_blocks=8, block_size=16, enable_prefix_caching=True)
    prompt = list(range(32))
    _admit_and_compute(kv, _request("a", prompt))
    hits, num_hit = kv.get_computed_blocks(_request("b", prompt))
    assert ([b.block_id for b in hits], num_hit) == ([0], 16)


def test_free_releases_the_tail_first_and_eviction_follows_it():
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _request("a", list(range(10)))
    assert _admit_and_compute(kv, a) == [0, 1, 2]
    kv.free(a)
    assert kv.req_to_blocks == {}
    assert _ref_cnts(kv) == [0] * 8
    # block 2 (partial, uncached) goes to the front; the cached tail block 1 before the head block 0
    assert kv.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    b = _request("b", list(range(100, 128)))  # 7 blocks: evicts the cached block 1
    assert kv.allocate_slots(b, 28) == [2, 3, 4, 5, 6, 7, 1]
    hits, num_hit = kv.get_computed_blocks(_request("c", list(range(10))))
    assert ([x.block_id for x in hits], num_hit) == ([0], 4)


def test_hits_on_free_blocks_count_against_free_space():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True)
    a = _request("a", list(range(12)))
    assert _admit_and_compute(kv, a) == [0, 1, 2]
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    b = _request("b", list(range(16)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert ([x.block_id for x in hits], num_hit) == ([0, 1, 2], 12)
    assert kv.allocate_slots(b, 4, hits) == [0, 1, 2, 3]
    assert _ref_cnts(kv) == [1, 1, 1, 1]
    c = _request("c", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert ([x.block_id for x in hits], num_hit) == ([0], 4)
    assert kv.allocate_slots(c, 4, hits) is None  # block 0 is shared, but no block is free for the rest
    assert _ref_cnts(kv) == [1, 1, 1, 1]
    assert "c" not in kv.req_to_blocks
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12 + 16, 12)


def test_allocate_slots_grows_the_table_one_block_at_a_time_while_decoding():
    kv = KVCacheManager(num_gpu_blocks=3, block_size=4, enable_prefix_caching=True)
    req = _request("a", [1, 2, 3])
    assert kv.allocate_slots(req, 3) == [0]
    req.num_computed_tokens = 3
    req.append_output_token(4)
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens = 4
    req.append_output_token(5)
    assert kv.allocate_slots(req, 1) == [1]
    assert kv.get_block_ids("a") == [0, 1]
    kv.cache_full_blocks(req)
    assert kv.pool.blocks[0].token_ids == (1, 2, 3, 4)
    assert kv.pool.blocks[1].block_hash is None


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True)
    assert kv.allocate_slots(_request("a", list(range(20))), 20) is None
    assert kv.num_free_blocks == 4 and kv.req_to_blocks == {}
    assert kv.prefix_cache_queries == 0


def test_a_hash_collision_is_caught_by_the_token_recheck():
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _request("a", [1, 2, 3, 4, 5])
    _admit_and_compute(kv, a)
    impostor = _request("b", [9, 9, 9, 9, 5])
    impostor.block_hashes = list(a.block_hashes)  # as if sha256 collided
    assert kv.get_computed_blocks(impostor) == ([], 0)


def test_cache_salt_separates_identical_prompts():
    kv = KVCacheManager(num_gpu_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    _admit_and_compute(kv, _request("a", prompt, cache_salt="tenant-1"))
    assert kv.get_computed_blocks(_request("b", prompt, cache_salt="tenant-2")) == ([], 0)
    assert kv.get_computed_blocks(_request("c", prompt))[1] == 0
    assert kv.get_computed_blocks(_request("d", prompt, cache_salt="tenant-1"))[1] == 8


def test_a_resumed_request_can_hit_its_own_prompt_and_outputs():
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=True)
    req = _request("a", [1, 2, 3, 4, 5, 6])
    _admit_and_compute(kv, req)
    for token in (7, 8, 9):
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
    kv.free(req)
    req.num_computed_tokens = 0
    hits, num_hit = kv.get_computed_blocks(req)  # 9 known tokens: the 2 full blocks hit
    assert ([b.block_id for b in hits], num_hit) == ([0, 1], 8)


def test_without_prefix_caching_nothing_is_cached_or_counted():
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=False)
    prompt = list(range(9))
    assert _admit_and_compute(kv, _request("a", prompt)) == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(_request("b", prompt)) == ([], 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


# ------------------------------------------------------------ the CPU tier (kv_offloading_size)
def test_evicted_cached_blocks_go_to_the_cpu_tier_and_come_back_on_a_hit():
    """An evicted cached block is copied out (ids after the swap space's); a prompt whose prefix runs past its GPU
    hits into CPU blocks gets new blocks filled from them before the forward, registered and counted as hits."""
    from asyncllm.kv.offload import CPUPrefixCache

    kv = KVCacheManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True, offload=CPUPrefixCache(10, 3))
    a = _request("a", list(range(13)))  # 3 full blocks + 1 token
    assert _admit_and_compute(kv, a) == [0, 1, 2, 3]
    kv.free(a)
    assert kv.take_offload_copies() == ([], [])
    b = _request("b", list(range(100, 113)))  # evicts a's cached blocks, least recently freed first
    assert _admit_and_compute(kv, b) == [3, 2, 1, 0]
    assert kv.take_offload_copies() == ([[2, 10], [1, 11], [0, 12]], [])
    kv.free(b)
    again = _request("c", list(range(13)))
    hits, num_hit = kv.get_computed_blocks(again)
    assert (hits, num_hit) == ([], 12)  # no GPU hit, three CPU blocks
    ids = kv.allocate_slots(again, 13 - 0, hits)
    assert ids is not None and len(ids) == 4
    out, loads = kv.take_offload_copies()
    assert loads == [[ids[0], 12], [ids[1], 11], [ids[2], 10]]
    assert out == []  # b's evicted blocks find no room: every CPU block is read this step
    assert (kv.prefix_cache_hits, kv.cpu_prefix_cache_hits) == (12, 12)
    again.num_computed_tokens = 13
    kv.cache_full_blocks(again)
    kv.free(again)
    assert [b.block_id for b in kv.get_computed_blocks(_request("d", list(range(13))))[0]] == ids[:3]  # on GPU now


def test_the_cpu_tier_keeps_a_block_once_and_evicts_its_least_recent_entry():
    from asyncllm.kv.offload import CPUPrefixCache

    tier = CPUPrefixCache(0, 2)
    tier.offload(5, b"x", (1, 2))
    tier.offload(6, b"x", (1, 2))  # held already: no copy
    tier.offload(7, b"y", (3, 4))
    assert tier.take_copies() == ([[5, 0], [7, 1]], [])
    assert tier.lookup(b"x", [1, 2]) == 0 and tier.lookup(b"x", [9, 9]) is None  # tokens re-checked
    tier.offload(8, b"z", (5, 6))  # evicts y (x was hit since), not the pinned x
    assert tier.take_copies() == ([[8, 1]], []) and tier.lookup(b"y", [3, 4]) is None
    tier.lookup(b"x", [1, 2])
    tier.lookup(b"z", [5, 6])
    tier.offload(9, b"w", (7, 8))  # both entries read this step: nothing to evict, no copy
    assert tier.take_copies() == ([], []) and tier.num_used_blocks == 2
    tier.reset()
    assert tier.lookup(b"x", [1, 2]) is None and tier.num_used_blocks == 0


def test_a_preempted_requests_readmission_is_no_prefix_cache_query():
    """As vLLM's (its preempted lookups are kept apart, not exported): the prompt was counted once, and hits on the
    request's own freed blocks are no sharing, so distinct prompts under KV pressure show no hit rate."""
    kv = KVCacheManager(num_gpu_blocks=16, block_size=16, enable_prefix_caching=True)
    req = _request("a", list(range(100, 140)))
    _admit_and_compute(kv, req)
    kv.free(req)
    req.num_preemptions += 1
    req.num_computed_tokens = 0
    _admit_and_compute(kv, req)  # readmitted: hits on its own 2 freed blocks
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.preempted_prefix_cache_hits) == (40, 0, 32)


def test_a_preempted_readmission_from_the_cpu_tier_is_no_cpu_hit_either():
    """cpu_prefix_cache_hits is a part of prefix_cache_hits, counted under the same rule."""
    from asyncllm.kv.offload import CPUPrefixCache

    kv = KVCacheManager(num_gpu_blocks=4, block_size=4, enable_prefix_caching=True, offload=CPUPrefixCache(10, 3))
    a = _request("a", list(range(13)))
    _admit_and_compute(kv, a)
    kv.free(a)
    a.num_preemptions, a.num_computed_tokens = 1, 0
    b = _request("b", list(range(100, 113)))
    _admit_and_compute(kv, b)  # evicts a's blocks to the CPU tier
    kv.take_offload_copies()
    kv.free(b)
    hits, num_hit = kv.get_computed_blocks(a)  # a readmitted: its 3 blocks loaded back from the CPU tier
    assert (hits, num_hit) == ([], 12) and kv.allocate_slots(a, 13, hits) is not None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.cpu_prefix_cache_hits) == (26, 0, 0)
    assert kv.preempted_prefix_cache_hits == 12  # kept apart


def test_a_request_that_skips_prefix_cache_reads_is_no_query():
    """As vLLM's KVCacheManager (`record_prefix_cache_stats` returns early for `skip_reading_prefix_cache`):
    prompt_logprobs and MEAN/CLS pooling read no block, so they count neither a query nor a hit."""
    from asyncllm.pooling import PoolingParams

    kv = KVCacheManager(num_gpu_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 110))
    _admit_and_compute(kv, _request("a", prompt))
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    logprobs = Request("b", prompt, SamplingParams(prompt_logprobs=1), [0], 0.0)
    mean = Request("c", prompt, SamplingParams(max_tokens=1), [0], 0.0, pooling=PoolingParams(pooling_type="MEAN"))
    for req in (logprobs, mean):
        assert req.skip_reading_prefix_cache
        assert kv.get_computed_blocks(req) == ([], 0)
        assert kv.allocate_slots(req, req.num_tokens, []) is not None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.preempted_prefix_cache_hits) == (10, 0, 0)
    last = Request("d", prompt, SamplingParams(max_tokens=1), [0], 0.0, pooling=PoolingParams(pooling_type="LAST"))
    assert not last.skip_reading_prefix_cache
    _admit_and_compute(kv, last)  # LAST pooling reads the cache: a query with its 8 hit tokens
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
