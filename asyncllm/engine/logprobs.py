"""Host side of logprobs: packed worker arrays -> `Logprob` dicts, on the processor thread.

The workers send `protocol.LogprobsArrays` (token ids, float32 logprobs and
ranks as raw bytes); here each row becomes ``{token_id: Logprob}`` with the
row's own token first, then the top-N in order. ``decoded_token`` is the
token decoded alone with special tokens kept (as vLLM), cached per id since
the same tokens recur in every top-N list.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from asyncllm.protocol import LogprobsArrays

__all__ = ["LogprobsDecoder", "PromptLogprobsBuffer"]


def _no_text(token_id: int) -> None:
    return None


class LogprobsDecoder:
    """Builds `Logprob` dicts from packed arrays; one per processor thread (its cache is not locked)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def decode(self, arrays: LogprobsArrays, with_text: bool = True) -> SampleLogprobs:
        """One dict per row: the row's own token with its rank, then the top-N with ranks 1..N (``decoded_token``
        None without ``with_text``: a request with detokenize=False). An own token that is also in the top-N keeps
        its place first but takes its top-N rank, as vLLM's dict comprehension gives it (they differ on ties)."""
        width = arrays.width
        ids = np.frombuffer(arrays.token_ids, "<i4").reshape(-1, width).tolist()
        values = np.frombuffer(arrays.logprobs, "<f4").reshape(-1, width).tolist()
        ranks = np.frombuffer(arrays.ranks, "<i4").tolist()
        text = self.token_text if with_text else _no_text
        out: SampleLogprobs = []
        for row_ids, row_values, rank in zip(ids, values, ranks):
            entry = {row_ids[0]: Logprob(row_values[0], rank, text(row_ids[0]))}
            for k in range(1, width):
                entry[row_ids[k]] = Logprob(row_values[k], k, text(row_ids[k]))
            out.append(entry)
        return out


class PromptLogprobsBuffer:
    """Collects one request's prompt logprobs as its prefill chunks are computed.

    Rows are written at their prompt positions, so a chunk computed twice
    (a preemption before the first token) overwrites itself with the same values.
    """

    def __init__(self, num_prompt_tokens: int) -> None:
        self.entries: PromptLogprobs = [None] * num_prompt_tokens

    def add(self, arrays: LogprobsArrays, decoder: LogprobsDecoder, with_text: bool = True) -> None:
        rows = decoder.decode(arrays, with_text)
        self.entries[arrays.start : arrays.start + len(rows)] = rows
