"""The worker's side of structured output: mask the logits with the core's grammar bitmask.

A torch equivalent of xgrammar's `apply_token_bitmask_inplace` (so workers need
no xgrammar): the packed int32 words are unpacked to one bool per token and
every disallowed token's logit becomes -inf before the sampler sees it, so
penalties, temperature, top-k/p and logprobs all work on the allowed tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from asyncllm.protocol import GrammarBitmask

__all__ = ["apply_grammar_bitmask", "pack_tokens", "unpack_bitmask"]

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, W] int32 words -> [rows, vocab_size] bool, True where the token is allowed (bit j of word w: 32w + j)."""
    bits = (words.unsqueeze(-1) >> _BITS.to(words.device)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def pack_tokens(token_ids: Iterable[int], num_words: int) -> torch.Tensor:
    """[num_words] int32 words with the bits of `token_ids` set (`unpack_bitmask`'s layout; bit 31 the sign)."""
    bits = torch.zeros(num_words * 32, dtype=torch.int64)
    bits[list(token_ids)] = 1
    words = (bits.view(num_words, 32) << _BITS.long()).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask, row_req_ids: list[str],
                          drafted: Mapping[str, tuple[int, int]] | None = None) -> None:
    """Set to -inf, in place, the logits of tokens the grammar forbids; `row_req_ids[i]` is the request of row i
    (its last position's); ``drafted``: a drafted request's (first draft position's row, number of drafts), whose
    bitmask rows at earlier positions go to its draft positions' rows."""
    row_of = {req_id: i for i, req_id in enumerate(row_req_ids)}
    rows = [row_of[req_id] for req_id in grammar.req_ids]
    for i, (req_id, position) in enumerate(zip(grammar.req_ids, grammar.positions)):
        first, num_drafts = (drafted or {}).get(req_id, (0, 0))
        if position < num_drafts:
            rows[i] = first + position
    words = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32).view(len(rows), -1)
    vocab_size = logits.shape[-1]
    if words.shape[1] * 32 < vocab_size:
        raise ValueError(f"grammar bitmask covers {words.shape[1] * 32} tokens, the logits {vocab_size}")
    allowed = unpack_bitmask(words.to(logits.device), vocab_size)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
