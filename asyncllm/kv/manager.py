"""`KVCacheManager`: which blocks each request holds, and prefix-cache hits.

The scheduler sees block ids and opaque `KVCacheBlock` handles only. The usual
sequence for one request is::

    blocks, num_hit = manager.get_computed_blocks(req)         # admission only
    new_ids = manager.allocate_slots(req, n, blocks)            # None: not enough blocks
    manager.cache_full_blocks(req, req.num_computed_tokens + n) # register the blocks this step fills
    ... the model computes the n tokens ...
    manager.free(req)                                           # finished, aborted or preempted

Blocks are registered in the prefix cache when they are scheduled, before the
model computes them: a request admitted later in the same step (the n samples
of one prompt) hits them and reads KV that the same forward pass writes (every
attention backend stores a layer's K/V for the whole batch before that layer's
attention reads the cache). Such a block becomes safe to hand out in a later
step only once its step ran; a step either runs or is lost with the workers
(which resets the whole prefix cache), and `free` unregisters the blocks of a
request freed before its scheduled tokens were applied
(docs/scheduling.md, "Prompt sharing in one step").

Every call is O(blocks of that request touched by the call): nothing walks
the whole pool, so a decode step costs O(running requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from asyncllm.kv.block_pool import BlockPool, KVCacheBlock
from asyncllm.kv.hashing import BlockHash, CacheSalt, MultiModalPlaceholder, extend_block_hashes, hash_block_tokens
from asyncllm.kv.offload import CPUPrefixCache
from asyncllm.kv.state_checkpoints import StateCheckpoints

__all__ = ["KVCacheManager", "KVRequest", "cdiv"]


class KVRequest(Protocol):
    """What the manager reads from a request (`asyncllm.sched.request.Request` has it)."""

    request_id: str
    num_computed_tokens: int
    cache_salt: CacheSalt
    lora_int_id: int
    """The request's LoRA adapter (0: none): keys its blocks like the salt."""
    mm_items: Sequence[MultiModalPlaceholder]
    """Images whose hashes and offsets key the blocks they overlap."""
    block_hashes: list[BlockHash]
    """Hashes of the request's full blocks, filled lazily by the manager."""
    num_preemptions: int
    """Times it was preempted (its readmissions are no prefix-cache queries)."""

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether it reads no prefix-cache block (prompt_logprobs, MEAN/CLS pooling): no lookup, no query."""
        ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (the blocks that ``a`` tokens take)."""
    return -(-a // b)


class KVCacheManager:
    """Owns the `BlockPool` and each request's block table (`req_to_blocks`)."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool,
                 checkpoints: StateCheckpoints | None = None, offload: CPUPrefixCache | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.checkpoints = checkpoints
        """A hybrid model's saved states (asyncllm/kv/state_checkpoints.py): hits end where states are saved."""
        self.pool = BlockPool(num_gpu_blocks)
        self.offload = offload if enable_prefix_caching else None
        """Evicted cached blocks kept in CPU memory (kv_offloading_size; asyncllm/kv/offload.py)."""
        if self.offload is not None:
            self.pool.on_evict = self.offload.offload
        self._cpu_hits: dict[str, list[int]] = {}
        """req_id -> the CPU blocks its last lookup found after its GPU hits (loaded when it is admitted)."""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        """req_id -> the blocks of its block table, in order."""
        self._num_cached_blocks: dict[str, int] = {}
        """req_id -> how many leading blocks of its table are registered in the prefix cache."""
        self.prefix_cache_queries = 0
        """Tokens of admitted requests looked up in the prefix cache."""
        self.prefix_cache_requests = 0
        """Admitted requests that looked up the prefix cache (vLLM's ``PrefixCacheStats.requests``: the stats line's
        hit rate is over the most recent 1000 of them)."""
        self.prefix_cache_hits = 0
        """Tokens of those found in the prefix cache."""
        self.cpu_prefix_cache_hits = 0
        """Tokens of those hits loaded back from the CPU tier."""
        self.preempted_prefix_cache_hits = 0
        """Tokens preempted requests found again at their readmission (kept apart, as vLLM's: not queries)."""

    # ------------------------------------------------------------ queries
    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_gpu_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (`BlockPool.reset_prefix_cache`, the CPU tier) and saved state."""
        self.pool.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.reset()
        if self.offload is not None:
            self.offload.reset()
            self._cpu_hits.clear()

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table as block ids (empty when it holds none)."""
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: KVRequest, offloaded: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks (GPU hits), and how many tokens it covers with the CPU tier's
        blocks after them (with ``offloaded``: loaded when `allocate_slots` admits the request).

        Never the whole sequence: the last known token is always recomputed so
        that the model produces the logits of the next one. Read-only: the
        blocks are only taken by `allocate_slots`.
        """
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return [], 0
        token_ids = request.all_token_ids
        max_blocks = (request.num_tokens - 1) // self.block_size
        extend_block_hashes(request.block_hashes, token_ids, self.block_size, max_blocks, request.cache_salt,
                            request.mm_items, request.lora_int_id)
        hits: list[KVCacheBlock] = []
        bs = self.block_size
        for index in range(max_blocks):
            block = self.pool.get_cached_block(request.block_hashes[index], token_ids[index * bs : (index + 1) * bs])
            if block is None:
                break
            hits.append(block)
        cpu_hits = self._cpu_lookup(request, len(hits), max_blocks) if offloaded and self.offload else []
        if self.checkpoints is not None:
            num = self.checkpoints.cut_hit(request, [*hits, *cpu_hits])
            hits, cpu_hits = hits[:num], cpu_hits[: max(num - len(hits), 0)]
        if cpu_hits:
            self._cpu_hits[request.request_id] = cpu_hits
        else:
            self._cpu_hits.pop(request.request_id, None)
        return hits, (len(hits) + len(cpu_hits)) * bs

    def _cpu_lookup(self, request: KVRequest, start: int, max_blocks: int) -> list[int]:
        """The CPU tier's blocks that continue the request's prefix from block ``start``."""
        assert self.offload is not None
        found, bs, token_ids = [], self.block_size, request.all_token_ids
        for index in range(start, max_blocks):
            cpu_id = self.offload.lookup(request.block_hashes[index], token_ids[index * bs : (index + 1) * bs])
            if cpu_id is None:
                break
            found.append(cpu_id)
        return found

    def take_offload_copies(self) -> tuple[list[list[int]], list[list[int]]]:
        """The step's CPU-tier copies, ([gpu, cpu] out, [gpu, cpu] in); none without a CPU tier."""
        return self.offload.take_copies() if self.offload is not None else ([], [])

    def num_blocks_to_allocate(
        self, request: KVRequest, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> int:
        """Free blocks `allocate_slots` would take for these arguments (revived prefix hits included)."""
        blocks = self.req_to_blocks.get(request.request_id)
        hits = new_computed_blocks or []
        num_held = len(hits) + (len(blocks) if blocks is not None else 0)
        num_tokens = request.num_computed_tokens + num_new_tokens + len(hits) * self.block_size
        num_new_blocks = max(cdiv(num_tokens, self.block_size) - num_held, 0)
        return num_new_blocks + sum(1 for block in hits if block.ref_cnt == 0)

    # ------------------------------------------------------------ actions
    def allocate_slots(
        self, request: KVRequest, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens.

        `new_computed_blocks` are prefix hits from `get_computed_blocks` (at
        admission, while the request holds no blocks); their tokens count as
        computed. Returns the ids appended to the block table (hits first), or
        None, changing nothing, when the free queue is too short; cached free
        blocks are evicted oldest first to make room.
        """
        assert num_new_tokens > 0, num_new_tokens
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        num_needed = request.num_computed_tokens + num_new_tokens
        bs = self.block_size
        if blocks is not None and not new_computed_blocks:  # a running request: no hits, plain growth
            num_new_blocks = cdiv(num_needed, bs) - len(blocks)
            if num_new_blocks <= 0:
                return []  # the decode fast path: the last block still has room
            if num_new_blocks == 1:  # a decode entering its next block
                block = self.pool.allocate_one()
                if block is None:
                    return None
                blocks.append(block)
                return [block.block_id]
            if num_new_blocks > self.pool.num_free_blocks:
                return None
            appended = self.pool.allocate(num_new_blocks)
            blocks.extend(appended)
            return [block.block_id for block in appended]
        hits = new_computed_blocks or []
        num_held = len(hits) + (len(blocks) if blocks is not None else 0)
        num_new_blocks = max(cdiv(num_needed + len(hits) * bs, bs) - num_held, 0)
        num_revived = sum(1 for block in hits if block.ref_cnt == 0)
        if not self.pool.can_allocate(num_new_blocks + num_revived):
            return None
        admitted = blocks is None
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
        self.pool.touch(hits)
        appended = hits + self.pool.allocate(num_new_blocks)
        blocks.extend(appended)
        if admitted:
            num_loaded = self._load_cpu_hits(request, appended, len(hits))
            self._num_cached_blocks[req_id] = len(hits) + num_loaded
            self._count_query(request, len(hits), num_loaded)
        return [block.block_id for block in appended]

    def _load_cpu_hits(self, request: KVRequest, blocks: list[KVCacheBlock], start: int) -> int:
        """The request's CPU-tier hits copied into its new blocks from ``start`` (registered in the prefix cache:
        their KV is there before the step's forward); how many."""
        cpu_hits = self._cpu_hits.pop(request.request_id, None)
        if not cpu_hits:
            return 0
        assert self.offload is not None and start + len(cpu_hits) <= len(blocks), (start, cpu_hits, len(blocks))
        bs, token_ids = self.block_size, request.all_token_ids
        for index, cpu_id in enumerate(cpu_hits, start):
            block = blocks[index]
            self.offload.load(cpu_id, block.block_id)
            self.pool.cache_block(block, request.block_hashes[index], token_ids[index * bs : (index + 1) * bs])
        return len(cpu_hits)

    def cache_full_blocks(self, request: KVRequest, num_tokens: int | None = None) -> None:
        """Register the request's blocks that are full in its first `num_tokens` tokens (default: its computed ones).

        The scheduler passes the tokens computed once this step has run, so
        that a request admitted later in the same step can hit them.
        """
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        start = self._num_cached_blocks.get(req_id)
        bs = self.block_size
        end = (request.num_computed_tokens if num_tokens is None else num_tokens) // bs
        if start is None or end <= start:
            return  # the decode fast path: no block became full
        blocks = self.req_to_blocks[req_id]
        if end > len(blocks):
            end = len(blocks)
        token_ids, block_hashes = request.all_token_ids, request.block_hashes
        if end == start + 1 == len(block_hashes) + 1 and start and not request.mm_items:
            # one block of a decode, no extra keys (the salt and the LoRA id key block 0 only): `extend_block_hashes` inlined
            block_tokens = token_ids[start * bs : end * bs]
            if len(block_tokens) == bs:  # else its last token is an async-scheduling placeholder: registered later
                self._cache_decode_block(req_id, blocks, block_hashes, start, block_tokens)
            return
        if len(block_hashes) < end:
            extend_block_hashes(block_hashes, token_ids, bs, end, request.cache_salt, request.mm_items,
                                request.lora_int_id)
            end = min(end, len(block_hashes))  # async scheduling: a block ending in a placeholder waits for its token
        cache_block = self.pool.cache_block
        for index in range(start, end):
            block = blocks[index]
            if block.block_hash is None:
                cache_block(block, block_hashes[index], token_ids[index * bs : (index + 1) * bs])
        self._num_cached_blocks[req_id] = end

    def append_decode_blocks(self, requests: Sequence[KVRequest], num_computed: Sequence[int],
                             new_block_ids: dict[str, list[int]]) -> int:
        """One-token decodes whose token starts a block (`num_computed` a multiple of the block size): a block
        for each, in order, its id into `new_block_ids`; how many got one (fewer when the free queue ran dry)."""
        tables, allocate_one, bs = self.req_to_blocks, self.pool.allocate_one, self.block_size
        for i, (request, computed) in enumerate(zip(requests, num_computed)):
            req_id = request.request_id
            blocks = tables[req_id]
            if len(blocks) * bs > computed:
                continue  # its table already reaches past this token
            block = allocate_one()
            if block is None:
                return i
            blocks.append(block)
            new_block_ids[req_id] = [block.block_id]
        return len(requests)

    def cache_decode_blocks(self, requests: Sequence[KVRequest], num_tokens: Sequence[int]) -> None:
        """`cache_full_blocks(request, n)` for each, inlined for the usual case of a decode: one block filled, no
        multimodal keys (about one running request in `block_size` per decode step); the others go the general way."""
        if not self.enable_prefix_caching:
            return
        bs, num_cached, tables = self.block_size, self._num_cached_blocks, self.req_to_blocks
        cache_decode_block = self._cache_decode_block
        for request, end_token in zip(requests, num_tokens):
            req_id = request.request_id
            end = end_token // bs
            start = end - 1
            block_hashes = request.block_hashes
            blocks = tables[req_id]
            if num_cached.get(req_id) != start or len(block_hashes) != start or not start or request.mm_items \
                    or len(blocks) < end:
                self.cache_full_blocks(request, end_token)
                continue
            block_tokens = request.all_token_ids[start * bs : end_token]
            if len(block_tokens) == bs:  # else its last token is an async-scheduling placeholder: registered later
                cache_decode_block(req_id, blocks, block_hashes, start, block_tokens)

    def _cache_decode_block(self, req_id: str, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int,
                            block_tokens: list[int]) -> None:
        """Hash and register block `start` of a request whose earlier blocks are hashed (a decode filled it; no
        extra keys: the salt and the LoRA id key block 0 only, multimodal requests go the general way)."""
        block_hash = hash_block_tokens(block_hashes[-1], block_tokens)
        block_hashes.append(block_hash)
        block = blocks[start]
        if block.block_hash is None:
            self.pool.cache_block(block, block_hash, block_tokens)
        self._num_cached_blocks[req_id] = start + 1

    def holders_of(self, firsts: dict[str, int]) -> dict[str, str]:
        """The other requests holding a block of these requests' tables from their index ``firsts[req_id]`` on:
        holder id -> the request whose block it holds."""
        owner = {block.block_id: req_id for req_id, first in firsts.items()
                 for block in self.req_to_blocks.get(req_id, ())[first:]}
        holders = {}
        for req_id, blocks in self.req_to_blocks.items():
            source = None if req_id in firsts else next((owner[b.block_id] for b in blocks if b.block_id in owner), None)
            if source is not None:
                holders[req_id] = source
        return holders

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks; the tail goes first so that it is evicted first.

        Blocks it registered for tokens not yet computed (freed between
        `schedule()` and `update_from_output()`) leave the prefix cache first:
        nothing may hit them in a later step.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        num_cached = self._num_cached_blocks.pop(req_id, 0)
        self._cpu_hits.pop(req_id, None)
        if not blocks:
            return
        num_computed_blocks = request.num_computed_tokens // self.block_size
        if num_cached > num_computed_blocks:
            self.pool.uncache(blocks[num_computed_blocks:num_cached])
        self.pool.free(reversed(blocks))

    def _count_query(self, request: KVRequest, num_gpu_hits: int, num_cpu_hits: int) -> None:
        """Count one admission's lookup (once per admission, however often admission was retried); a preempted
        request's readmission is not counted (as vLLM's, whose preempted lookups are kept apart and not exported):
        its prompt was counted once, and its hits on its own freed blocks are no sharing. A request that skips
        prefix-cache reads made no lookup and is not counted at all (vLLM's `record_prefix_cache_stats`)."""
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return
        if request.num_preemptions:
            self.preempted_prefix_cache_hits += (num_gpu_hits + num_cpu_hits) * self.block_size
        else:
            self.prefix_cache_requests += 1
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += (num_gpu_hits + num_cpu_hits) * self.block_size
            self.cpu_prefix_cache_hits += num_cpu_hits * self.block_size
