"""`StepOutputs`: what one engine-core round tells the hosts, grouped for the wire.

Most outputs of a busy step are one decode token for a request that neither
finished nor has anything else to report. Those travel as two parallel lists
per host (request ids, token ids: `protocol.Outputs.token_req_ids` /
`token_ids`) instead of one `RequestOutputDelta` each: the scheduler appends
two list items per request where it used to build a struct and a tuple, the
core sends the lists as they are, and msgspec encodes and decodes two flat
arrays. Everything else (first tokens, finishes, events, errors, logprobs,
structured-output requests, several tokens) is a full delta.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from asyncllm import protocol

__all__ = ["StepOutputs"]


class StepOutputs:
    """Full deltas in step order, and the one-token outputs as (request ids, token ids) per host."""

    __slots__ = ("deltas", "tokens")

    def __init__(self, deltas: Iterable[tuple[bytes, protocol.RequestOutputDelta]] = ()) -> None:
        self.deltas: list[tuple[bytes, protocol.RequestOutputDelta]] = list(deltas)
        self.tokens: dict[bytes, tuple[list[str], list[int]]] = {}
        """client_id -> (request ids, the one new token of each)."""

    def token_lists(self, client_id: bytes) -> tuple[list[str], list[int]]:
        """The host's (request ids, token ids) lists, created empty on first use."""
        lists = self.tokens.get(client_id)
        if lists is None:
            lists = self.tokens[client_id] = ([], [])
        return lists

    def extend(self, other: StepOutputs | Iterable[tuple[bytes, protocol.RequestOutputDelta]]) -> None:
        """Add another round's outputs (a request appears in at most one of them)."""
        if not isinstance(other, StepOutputs):
            self.deltas.extend(other)
            return
        self.deltas.extend(other.deltas)
        for client_id, (req_ids, token_ids) in other.tokens.items():
            mine = self.token_lists(client_id)
            mine[0].extend(req_ids)
            mine[1].extend(token_ids)

    def __add__(self, other: StepOutputs | list[tuple[bytes, protocol.RequestOutputDelta]]) -> StepOutputs:
        combined = StepOutputs()
        combined.extend(self)
        combined.extend(other)
        return combined

    def __radd__(self, other: list[tuple[bytes, protocol.RequestOutputDelta]]) -> StepOutputs:
        combined = StepOutputs(other)
        combined.extend(self)
        return combined

    def __iter__(self) -> Iterator[tuple[bytes, protocol.RequestOutputDelta]]:
        """Every output as (client_id, delta): the full deltas, then each one-token output as a delta."""
        yield from self.deltas
        for client_id, (req_ids, token_ids) in self.tokens.items():
            for req_id, token in zip(req_ids, token_ids):
                yield client_id, protocol.RequestOutputDelta(req_id, [token])

    def __len__(self) -> int:
        return len(self.deltas) + sum(len(req_ids) for req_ids, _ in self.tokens.values())

    def __bool__(self) -> bool:
        return bool(self.deltas) or any(req_ids for req_ids, _ in self.tokens.values())
