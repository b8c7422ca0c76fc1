"""A sampled token tied with another: its rank as vLLM's logprobs dict gives it."""

from __future__ import annotations

import numpy as np

from asyncllm.engine.logprobs import LogprobsDecoder
from asyncllm.outputs import Logprob
from asyncllm.workers.logprobs import pack_logprobs


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return f"t{ids[0]}"


def test_a_sampled_token_in_the_top_n_takes_its_top_n_rank() -> None:
    """Tokens 5 and 7 tie: 5 is sampled with rank 2 (two tokens at least as likely), and is the top-1 too. vLLM's
    dict comprehension lets the top-1 entry overwrite it (rank 1), keeping the sampled token first."""
    ids = np.array([[5, 5, 7], [7, 5, 7]])
    values = np.full((2, 3), -0.69, dtype=np.float32)
    rows = LogprobsDecoder(_Tokenizer()).decode(pack_logprobs(ids, values, np.array([2, 2])))
    value = float(values[0, 0])
    assert rows[0] == {5: Logprob(value, 1, "t5"), 7: Logprob(value, 2, "t7")}
    assert rows[1] == {7: Logprob(value, 2, "t7"), 5: Logprob(value, 1, "t5")}
    assert [list(row) for row in rows] == [[5, 7], [7, 5]]
