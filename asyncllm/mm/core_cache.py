"""The core's half of the processor cache, for both cache types (docs/multimodal.md).

``lru``: the data of the key-replicated cache (`ProcessorCacheStore`), shared
by every host attached to the core. ``shm``: each host that named a ring in its
`Hello` has one `ShmRingReader`; an item carrying a ring location is copied out
of that host's ring when its request arrives, so a later overwrite of the
entry cannot touch it. Either way the items the scheduler and the workers see
carry their data.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from asyncllm.config import MultiModalConfig
from asyncllm.mm.cache import ProcessorCacheStore, fill_mm_items
from asyncllm.mm.shm_ring import ShmRingReader
from asyncllm.protocol import AddRequest

__all__ = ["CoreProcessorCache"]

logger = logging.getLogger("asyncllm.mm")

_RING_NAME = re.compile(r"asyncllm-\d+-mm-[0-9a-f]+")
"""What `ShmRingWriter` names its segments: a Hello naming any other segment is not mapped."""


class CoreProcessorCache:
    """The lru store (when the core's own config asks for one) and one ring reader per host."""

    def __init__(self, config: MultiModalConfig) -> None:
        lru = config.mm_processor_cache_type == "lru" and config.mm_processor_cache_gb > 0
        self.store = ProcessorCacheStore(int(config.mm_processor_cache_gb * 2**30)) if lru else None
        self.rings: dict[bytes, ShmRingReader] = {}
        self.piece_merge = 0
        """The served model's `asyncllm.protocol.WorkerReady.mm_piece_merge`: the pieces its workers take."""
        self.piece_audio_window = 0
        """The served model's audio encoder window by which an audio piece's whole is checked (Qwen3-Omni's
        ``n_window``; 0: Qwen2.5-Omni's pooling): asyncllm/mm/cache.py's `fill_mm_items`."""

    def attach(self, client_id: bytes, ring_name: str) -> bool:
        """Map the ring a host named in its Hello; False when there is none or it cannot be mapped here."""
        self.detach(client_id)
        if not ring_name:
            return False
        if not _RING_NAME.fullmatch(ring_name):
            logger.warning("a host named %r as its shm processor cache: not an asyncllm ring, not mapped", ring_name[:80])
            return False
        try:
            self.rings[client_id] = ShmRingReader(ring_name)
        except (OSError, ValueError) as exc:  # another machine's ring (tcp://), or already unlinked
            logger.warning("cannot map the shm processor cache %r of a host (%s): it will send image data", ring_name, exc)
            return False
        return True

    def detach(self, client_id: bytes) -> None:
        ring = self.rings.pop(client_id, None)
        if ring is not None:
            ring.close()

    def fill(self, client_id: bytes, message: AddRequest) -> None:
        """Give every item of ``message`` its data (`MultiModalCacheMiss` naming the ones no cache holds)."""
        fill_mm_items(self.store, message, self.rings.get(client_id), self.piece_merge, self.piece_audio_window)

    def forget(self, mm_hashes: Iterable[str]) -> None:
        """Drop these keys from the lru store (their host resends their data when it next sends them)."""
        for mm_hash in mm_hashes if self.store is not None else ():
            self.store.drop(mm_hash)

    def close(self) -> None:
        for client_id in list(self.rings):
            self.detach(client_id)

