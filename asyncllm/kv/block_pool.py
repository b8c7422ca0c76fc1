"""The pool of KV-cache blocks: reference counts, the free LRU and the prefix-cache map.

Plain Python over integers; the worker holds the tensors, the pool only
decides which block ids hold what. A block whose reference count drops to
zero goes to the free queue but keeps its hash and tokens, so a later request
with the same prefix can take it back (a prefix hit) until it is evicted,
which happens only when the block is handed out again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from asyncllm.kv.hashing import BlockHash

__all__ = ["KVCacheBlock", "BlockPool"]


class KVCacheBlock:
    """One block of the paged KV cache: an opaque handle outside the kv package."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        """Requests whose block table holds this block."""
        self.block_hash: BlockHash | None = None
        """Set once the block is full and registered in the prefix cache (when its step is scheduled)."""
        self.token_ids: tuple[int, ...] | None = None
        """The tokens of a cached block, re-checked on every hit."""

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """`num_gpu_blocks` blocks with ids 0..N-1, a free LRU and a hash -> block map.

    The free queue is ordered by eviction priority: `allocate` takes from the
    front. A freed cached block joins the back (least recently used goes
    first); a freed block without a hash holds nothing reusable and joins the
    front, so cached blocks survive as long as possible.
    """

    def __init__(self, num_gpu_blocks: int) -> None:
        assert num_gpu_blocks > 0, num_gpu_blocks
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_gpu_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict: Callable[[int, BlockHash, tuple[int, ...]], None] | None = None
        """Called with (block id, hash, tokens) of a cached block about to be handed out again (CPU offloading:
        asyncllm/kv/offload.py)."""

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return self.num_used_blocks / self.num_gpu_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first evicted first); O(free blocks), for tests and debugging."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The cached block for `block_hash`, if its stored tokens equal `token_ids`."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    # ------------------------------------------------------------ actions
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue (evicting their cache entries)."""
        free = self._free
        assert num_blocks <= len(free), (num_blocks, len(free))
        taken = []
        for _ in range(num_blocks):
            _, block = free.popitem(last=False)
            if block.block_hash is not None:
                self._hand_out(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def allocate_one(self) -> KVCacheBlock | None:
        """`allocate(1)`'s block, or None when no block is free (a decode's next block: the hot path)."""
        if not self._free:
            return None
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            self._hand_out(block)
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit), out of the free queue if it was free."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in this order."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full block under `block_hash`; False if another block already holds it.

        The block may be computed in the step being scheduled (see
        `KVCacheManager`). When two requests computed the same prefix (one
        admitted before the other's blocks were registered), the second copy
        stays unregistered and is reused as a plain block once freed.
        """
        assert block.ref_cnt > 0 and block.block_hash is None, block
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop these blocks' prefix-cache entries (their KV was never computed); they stay allocated."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, free or held: no later lookup hits KV computed before now.

        Held blocks stay with their requests (their KV is still theirs) and
        return to the free queue as plain blocks; free ones are plain at once.
        With no block held the pool is as new (free queue in id order).
        """
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()
        if self.num_used_blocks == 0:
            self._free = OrderedDict((b.block_id, b) for b in self.blocks)

    def _hand_out(self, block: KVCacheBlock) -> None:
        """A cached free block taken for new KV: offered to ``on_evict``, then out of the cache."""
        if self.on_evict is not None and self._cached.get(block.block_hash) is block:  # type: ignore[arg-type]
            self.on_evict(block.block_id, block.block_hash, block.token_ids)  # type: ignore[arg-type]
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
