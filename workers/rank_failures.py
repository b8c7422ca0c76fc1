"""Failures one rank alone can meet (a file read), settled across every rank with no GPU sync.

Every rank decides alone from the same broadcast (docs/architecture.md), so a
failure that may happen on one rank and not another (an adapter folder rewritten
between two ranks' reads of it) must reach every rank before any acts on it;
otherwise one rank runs a request one way and another rank another way. The
ranks meet on a gloo group of their own, beside NCCL's: exchanging a few
pickled strings costs no GPU sync and leaves the device streams alone.

`settle` is a collective: every rank calls it at the same point of the same
step, so the decision to call it must come from state every rank shares (never
from the outcome of the rank's own read).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["host_group", "settle", "failure_detail"]


def host_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank of the engine (every stage's tensor-parallel ranks); None with one rank.

    A collective of every rank: each calls it at the same point, in the same order as its other groups."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def failure_detail(exc: BaseException, group: dist.ProcessGroup | None) -> str:
    """What the error says, with the rank it happened on when there are several."""
    detail = f"{type(exc).__name__}: {exc}"
    return detail if group is None else f"rank {dist.get_rank()}: {detail}"


def settle(failures: dict[int, str], group: dist.ProcessGroup | None) -> dict[int, str]:
    """Every rank's failures, on every rank: key -> the lowest failing rank's detail, keys in rank order then each
    rank's order. ``group`` None (one rank): `failures` as given."""
    if group is None:
        return failures
    gathered: list[dict[int, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, failures, group=group)
    settled: dict[int, str] = {}
    for rank_failures in gathered:
        assert rank_failures is not None
        for key, detail in rank_failures.items():
            settled.setdefault(key, detail)
    return settled
