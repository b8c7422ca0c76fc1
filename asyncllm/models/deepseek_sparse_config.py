"""DeepSeek Sparse Attention's layers, read from the config alone (no torch: the host's pipeline check reads them
too): which layers run their own lightning indexer, and the pipeline splits that keep each reused choice on the
stage of the indexer that made it (asyncllm/models/deepseek_sparse.py)."""

from __future__ import annotations

import itertools
from typing import Any

from asyncllm import envs
from asyncllm.errors import ConfigError

__all__ = ["check_indexer_split", "has_indexer"]


def has_indexer(hf_config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` runs its own indexer (GLM-5's "shared" layers, ``indexer_types``, reuse the
    choice of the indexer before them)."""
    types = getattr(hf_config, "indexer_types", None)
    return not types or types[layer_idx] != "shared"


def check_indexer_split(hf_config: Any, counts: list[int]) -> None:
    """`ConfigError` unless every stage after the first begins with a layer that runs its own indexer: a "shared"
    layer reuses the choice of the indexer before it, which no stage sends on (``counts``: layers per stage)."""
    starts = list(itertools.accumulate(counts[:-1]))
    apart = [start for start in starts if not has_indexer(hf_config, start)]
    if not apart:
        return
    # each boundary moved back to a layer with its own indexer
    moved = [max((i for i in range(start + 1) if has_indexer(hf_config, i)), default=0) for start in starts]
    bounds = [0, *moved, sum(counts)]
    fixed = [end - start for start, end in itertools.pairwise(bounds)]
    hint = f", e.g. {envs.PP_LAYER_PARTITION.name}={','.join(map(str, fixed))}" if min(fixed) > 0 else ""
    raise ConfigError(envs.PP_LAYER_PARTITION.name, ",".join(map(str, counts)),
                      f"a split whose every stage after the first begins with a layer that runs its own indexer "
                      f"(layer {apart[0]} reuses the choice of the indexer before it, on another stage: indexer_types "
                      f"'shared'){hint}")
