"""`BlockPool` under drawn operations (hypothesis), driven as `KVCacheManager` drives it, against a naive model.

Drawn: a pool of 1 to 7 blocks of 2 tokens, a few prompts over tokens 0-3 (most sharing a stem), and a list of
operations on requests: admit a prompt (look up its full blocks but the last token's, stop at the first miss, take the
hits and allocate the rest, or leave it waiting when too few blocks are free; with its whole prompt in one step, its
full blocks registered at once), register a request's next full blocks (a chunked prompt, a decode), decode a few
tokens (one new block: `allocate_one`; more: `allocate`), free a request as the manager does (the blocks it
registered for a step that never ran uncached first, then all freed tail first), probe the cache with a seen block's
hash and its own or other tokens, and reset the prefix cache. The block hashes chain as the real ones do but collide
on purpose (tokens 2k and 2k + 1 hash alike), so only the token re-check tells such blocks apart.

The model is lists: each block's reference count and registered (hash, tokens), and the free queue, with the rules
of the pool's docstrings and docs/scheduling.md ("Prefix caching"): `allocate` hands out the front of the queue,
evicting what a cached block held (offered to `on_evict` first); a block freed to zero joins the back when cached
(least recently freed evicted first) and the front when not; a prefix hit takes a free block out of the queue; a
reset forgets every hash and, with no block held, puts the queue back in id order. After every operation the pool
must match the model exactly: the free queue's order, each block's reference count, hash and tokens, every count,
each cached block hit by its hash and tokens (a free one too, until it is handed out again), and the references equal
to the requests' block tables; a hit returns the block holding that very hash and those tokens, or none.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.kv.block_pool import BlockPool, KVCacheBlock

BLOCK_SIZE = 2
ROOT = b"root"


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """A chained hash that collides on purpose: tokens 2k and 2k + 1 hash alike."""
    return hashlib.sha256(parent + bytes(token // 2 for token in tokens)).digest()


def full_block_hashes(tokens: list[int]) -> list[bytes]:
    hashes, parent = [], ROOT
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = block_hash(parent, tokens[start : start + BLOCK_SIZE])
        hashes.append(parent)
    return hashes


def block_tokens(tokens: list[int], index: int) -> list[int]:
    return tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Model:
    """Each block's references and registered (hash, tokens), and the free queue (first evicted first)."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.content: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self.free = list(range(num_blocks))
        self.evicted: list[tuple[int, bytes, tuple[int, ...]]] = []

    def lookup(self, digest: bytes, tokens: list[int]) -> int | None:
        found = [i for i, content in enumerate(self.content) if content == (digest, tuple(tokens))]
        assert len(found) <= 1, found
        return found[0] if found else None

    def allocate(self, num_blocks: int) -> list[int]:
        taken, self.free = self.free[:num_blocks], self.free[num_blocks:]
        for i in taken:
            if self.content[i] is not None:
                self.evicted.append((i, *self.content[i]))
            self.content[i] = None
            self.ref[i] = 1
        return taken

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref[i] == 0:
                self.free.remove(i)
            self.ref[i] += 1

    def free_blocks(self, ids: list[int]) -> None:
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                if self.content[i] is None:
                    self.free.insert(0, i)
                else:
                    self.free.append(i)

    def cache(self, i: int, digest: bytes, tokens: list[int]) -> bool:
        if any(content is not None and content[0] == digest for content in self.content):
            return False
        self.content[i] = (digest, tuple(tokens))
        return True

    def reset(self) -> None:
        self.content = [None] * len(self.content)
        if not any(self.ref):
            self.free = list(range(len(self.ref)))


@dataclass(eq=False)
class Req:
    """What the manager keeps for a request: its tokens, block table, hits and registered leading blocks."""

    tokens: list[int]
    blocks: list[KVCacheBlock]
    num_hits: int
    num_cached: int


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def admit(pool: BlockPool, model: Model, reqs: list[Req], prompt: list[int]) -> Req | None:
    """`get_computed_blocks` then `allocate_slots`: hits up to the first miss, never the last token's block."""
    hashes = full_block_hashes(prompt)
    hits: list[KVCacheBlock] = []
    for index in range((len(prompt) - 1) // BLOCK_SIZE):
        tokens = block_tokens(prompt, index)
        block = pool.get_cached_block(hashes[index], tokens)
        expected = model.lookup(hashes[index], tokens)
        assert (None if block is None else block.block_id) == expected, (index, block, expected)
        if block is None:
            break
        assert (block.block_hash, block.token_ids) == (hashes[index], tuple(tokens))
        hits.append(block)
    num_new = cdiv(len(prompt), BLOCK_SIZE) - len(hits)
    num_revived = sum(1 for i in _ids(hits) if model.ref[i] == 0)
    fits = num_new + num_revived <= len(model.free)
    assert pool.can_allocate(num_new + num_revived) == fits
    if not fits:
        return None
    pool.touch(hits)
    model.touch(_ids(hits))
    new = pool.allocate(num_new)
    assert _ids(new) == model.allocate(num_new)
    reqs.append(Req(list(prompt), hits + new, len(hits), len(hits)))
    return reqs[-1]


def register(pool: BlockPool, model: Model, req: Req, num_blocks: int) -> None:
    """`cache_full_blocks`: the next full blocks not registered yet; a hash held by another block stays unregistered."""
    end = min(req.num_cached + num_blocks, len(req.tokens) // BLOCK_SIZE, len(req.blocks))
    hashes = full_block_hashes(req.tokens)
    for index in range(req.num_cached, end):
        block, tokens = req.blocks[index], block_tokens(req.tokens, index)
        if model.content[block.block_id] is None:
            registered = pool.cache_block(block, hashes[index], tokens)
            assert registered == model.cache(block.block_id, hashes[index], tokens), index
    req.num_cached = max(req.num_cached, end)


def decode(pool: BlockPool, model: Model, req: Req, tokens: list[int]) -> None:
    """`allocate_slots` for a running request: `allocate_one` for one more block, `allocate` for more."""
    num_new = cdiv(len(req.tokens) + len(tokens), BLOCK_SIZE) - len(req.blocks)
    if num_new == 1:
        block = pool.allocate_one()
        if model.free:
            assert block is not None and [block.block_id] == model.allocate(1)
            req.blocks.append(block)
        else:
            assert block is None
            return
    elif num_new > 1:
        fits = num_new <= len(model.free)
        assert pool.can_allocate(num_new) == fits
        if not fits:
            return
        new = pool.allocate(num_new)
        assert _ids(new) == model.allocate(num_new)
        req.blocks.extend(new)
    req.tokens.extend(tokens)


def free(pool: BlockPool, model: Model, reqs: list[Req], req: Req, pick: int) -> None:
    """`KVCacheManager.free`: blocks registered past the computed ones uncached, then all freed tail first."""
    num_lost = 0 if pick < 15 else pick % (req.num_cached - req.num_hits + 1)  # blocks of a step that never ran
    num_computed = req.num_cached - num_lost
    uncached = req.blocks[num_computed : req.num_cached]
    pool.uncache(uncached)
    for i in _ids(uncached):
        model.content[i] = None
    pool.free(reversed(req.blocks))
    model.free_blocks(_ids(req.blocks)[::-1])
    reqs.remove(req)


def probe(pool: BlockPool, model: Model, digest: bytes, tokens: list[int]) -> None:
    block = pool.get_cached_block(digest, tokens)
    assert (None if block is None else block.block_id) == model.lookup(digest, tokens)
    if block is not None:
        assert (block.block_hash, block.token_ids) == (digest, tuple(tokens))


def seen_blocks(token_lists: list[list[int]]) -> list[tuple[bytes, list[int]]]:
    """Each full block's (hash, tokens) in these token lists."""
    found = {(digest, tuple(block_tokens(tokens, i))) for tokens in token_lists
             for i, digest in enumerate(full_block_hashes(tokens))}
    return [(digest, list(tokens)) for digest, tokens in sorted(found)]


def check(pool: BlockPool, model: Model, reqs: list[Req], evicted: list) -> None:
    n = pool.num_gpu_blocks
    free_ids = pool.free_block_ids()
    assert free_ids == model.free
    assert [b.ref_cnt for b in pool.blocks] == model.ref
    assert [b.ref_cnt for b in pool.blocks] == [sum(_ids(r.blocks).count(i) for r in reqs) for i in range(n)]
    assert sorted(free_ids) == [i for i in range(n) if model.ref[i] == 0]  # each block free or held, never both
    assert [None if b.block_hash is None else (b.block_hash, b.token_ids) for b in pool.blocks] == model.content
    num_free = len(model.free)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (num_free, n - num_free)
    assert pool.usage == (n - num_free) / n
    assert pool.can_allocate(num_free) and not pool.can_allocate(num_free + 1)
    cached = [(i, content) for i, content in enumerate(model.content) if content is not None]
    assert pool.num_cached_blocks == len(cached)
    for i, (digest, tokens) in cached:  # a free cached block is still hit until it is handed out again
        assert pool.get_cached_block(digest, list(tokens)) is pool.blocks[i]
    assert evicted == model.evicted


KINDS = ["admit"] * 3 + ["prefill"] * 5 + ["register"] * 3 + ["decode"] * 3 + ["free"] * 7 + ["probe"] * 2 + ["reset"]
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=5)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[list[int]], list[tuple[str, int, list[int]]]]:
    num_blocks = draw(st.integers(1, 7))
    stem = draw(st.lists(st.integers(0, 3), min_size=2, max_size=6))
    suffixes = draw(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=4))
    prompts = [s if s and draw(st.booleans()) else stem + s for s in suffixes]
    ops = draw(st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 20), TOKENS), min_size=10, max_size=60))
    return num_blocks, prompts, ops


def run(num_blocks: int, prompts: list[list[int]], ops: list[tuple[str, int, list[int]]]) -> None:
    pool, model, reqs = BlockPool(num_blocks), Model(num_blocks), []
    evicted: list[tuple[int, bytes, tuple[int, ...]]] = []
    pool.on_evict = lambda block_id, digest, tokens: evicted.append((block_id, digest, tokens))
    seen = seen_blocks(prompts)
    for kind, pick, tokens in ops:
        req = reqs[pick % len(reqs)] if reqs else None
        if kind in ("admit", "prefill"):
            admitted = admit(pool, model, reqs, prompts[pick % len(prompts)])
            if admitted is not None and kind == "prefill":  # its whole prompt in one step: all full blocks registered
                register(pool, model, admitted, len(admitted.blocks))
        elif kind == "register" and req is not None:
            register(pool, model, req, 1 + pick % 3)
        elif kind == "decode" and req is not None:
            decode(pool, model, req, tokens)
            seen = seen_blocks([*prompts, *(r.tokens for r in reqs)])
        elif kind == "free" and req is not None:
            free(pool, model, reqs, req, pick)
        elif kind == "probe" and seen:  # a seen block's hash with its own tokens, or with drawn ones
            digest, own_tokens = seen[pick % len(seen)]
            probe(pool, model, digest, own_tokens if pick % 2 else (tokens * BLOCK_SIZE)[:BLOCK_SIZE])
        elif kind == "reset":
            pool.reset_prefix_cache()
            model.reset()
        check(pool, model, reqs, evicted)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
# one prompt twice: the second hits the first's block while it is held, then again once it is free
@example(case=(4, [[0, 1, 2, 3, 1]], [("admit", 0, [0]), ("register", 2, [0]), ("admit", 0, [0]),
                                      ("free", 0, [0]), ("free", 0, [0]), ("admit", 0, [0])]))
# tokens 0 and 1 collide: the second prompt's first block misses, its copy stays unregistered
@example(case=(3, [[0, 0, 2], [1, 1, 2]], [("admit", 0, [0]), ("register", 0, [0]), ("admit", 1, [0]),
                                           ("register", 1, [0]), ("probe", 0, [1, 1]), ("free", 1, [0])]))
# a request freed before its step ran drops the blocks it registered, although another request hit them meanwhile
@example(case=(5, [[0, 1, 2, 3, 1]], [("prefill", 0, [0]), ("admit", 0, [0]), ("free", 17, [0]), ("admit", 0, [0]),
                                      ("free", 0, [0]), ("free", 0, [0])]))
def test_the_pool_matches_a_model_of_references_free_queue_and_prefix_cache(case) -> None:
    run(*case)
