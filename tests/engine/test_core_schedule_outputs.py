"""Logprobs, prompt logprobs and structured outputs on replayable schedules (tests/engine/test_core_schedules.py's
in-process core, driven one busy-loop turn at a time): under preemption by recompute or swap, prefix caching,
chunked prefills and overlapped steps, each request's outputs must equal those of a core that runs one request at a
time. Sampled tokens exactly; each sampled token's logprob row (its own token first, then the top-N, and its rank)
with the same ids and ranks and values within `ATOL`; exactly one prompt-logprobs row for every prompt position from
the second on, a row computed again (a prefill recomputed after a preemption) equal to the first, as the host's
`PromptLogprobsBuffer` overwrites it in place; regex and choice constraints followed as the lone request follows them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from asyncllm import SamplingParams, StructuredOutputs, protocol
from test_core_schedules import Core, _pool, _round, sampling_cores
from test_random_schedules import _sampling

ATOL = 1e-3
"""float32 on the CPU: a batch of other rows changes a logprob in its last bits only."""
REGEXES = (r"[a-z]{2,8}( [a-z]{1,5}){0,3}", r"\d{1,3}(,\d{3}){0,4}", r"(ab|cd|ef)+x?")
CHOICES = (["yes", "no", "maybe so"], ["alpha", "beta", "gamma delta epsilon"])

Row = tuple[tuple[int, ...], np.ndarray, int]  # the row's token ids (own first), their logprobs, the own one's rank


def _rows(arrays: protocol.LogprobsArrays | None) -> list[tuple[int, Row]]:
    """(position, row) of each row: the prompt token's index for prompt logprobs, 0, 1, ... for sampled ones."""
    if arrays is None:
        return []
    ids = np.frombuffer(arrays.token_ids, np.int32).reshape(-1, arrays.width)
    values = np.frombuffer(arrays.logprobs, np.float32).reshape(-1, arrays.width)
    ranks = np.frombuffer(arrays.ranks, np.int32)
    return [(arrays.start + i, (tuple(ids[i].tolist()), values[i].copy(), int(ranks[i]))) for i in range(len(ids))]


class RecordingCore(Core):
    """A `Core` whose host also keeps each request's logprob rows and prompt-logprob rows (by prompt position)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logprobs: dict[str, list[Row]] = {}
        self.prompt_logprobs: dict[str, dict[int, Row]] = {}
        self.rows_computed_again = 0
        """Prompt-logprob rows sent a second time (a prefill recomputed after a preemption)."""
        structured, add = self.core.structured, self.core.structured.add

        def add_compiled(request: Any) -> None:
            """Compile the grammar at submit, so a replay admits the request at the same turn (the engine's compile
            thread would race the turns)."""
            add(request)
            structured.pending[request.request_id].future.exception(timeout=120)  # a hung compile fails, not hangs

        structured.add = add_compiled

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0) -> None:
        self.logprobs[request_id], self.prompt_logprobs[request_id] = [], {}
        super().add(request_id, prompt, params, priority)

    def record(self, delta: protocol.RequestOutputDelta) -> None:
        rows = _rows(delta.logprobs)
        assert delta.logprobs is None or len(rows) == len(delta.new_token_ids), delta
        self.logprobs[delta.request_id] += [row for _, row in rows]
        seen = self.prompt_logprobs[delta.request_id]
        for position, row in _rows(delta.prompt_logprobs):
            if position in seen:
                _assert_same_row(row, seen[position], f"{delta.request_id} prompt row {position} computed again")
                self.rows_computed_again += 1
            seen[position] = row


def _assert_same_row(got: Row, want: Row, what: str) -> None:
    """The same values within `ATOL`; the same own token; the same top-N ids and rank but where a near tie (another
    value within `ATOL`) may order them either way: another batch moves a logprob in its last bits."""
    np.testing.assert_allclose(got[1], want[1], atol=ATOL, err_msg=what)
    values = want[1][1:]
    tied = [bool(np.isclose(values, v, rtol=0, atol=ATOL).sum() > 1) for v in values]  # -inf ties -inf
    assert got[0][0] == want[0][0], f"{what}: own token {got[0][0]} != {want[0][0]}"
    assert all(a == b or t for a, b, t in zip(got[0][1:], want[0][1:], tied)), f"{what}: top ids {got[0]} != {want[0]}"
    assert abs(got[2] - want[2]) <= 1, f"{what}: rank {got[2]} != {want[2]}"  # a tie with a token outside the top-N


def _draw(rng: random.Random) -> SamplingParams:
    """`_sampling`'s settings, most with logprobs or prompt logprobs, half constrained by a regex or choices."""
    params = _sampling(rng)
    params.n = 1
    if rng.random() < 0.6:
        params.logprobs = rng.choice([0, 1, 5])
    if rng.random() < 0.4:
        params.prompt_logprobs = rng.choice([0, 2])
    if rng.random() < 0.5:
        params.min_tokens = 0  # refused with a constraint
        params.structured = (StructuredOutputs(regex=rng.choice(REGEXES)) if rng.random() < 0.6
                             else StructuredOutputs(choice=rng.choice(CHOICES))).for_core()
    return params


def _check(r: dict[str, Any], core: RecordingCore, alone: RecordingCore, what: str) -> None:
    tokens = alone.alone(r["prompt"], r["params"])
    request_id, alone_id = r["id"], f"alone-{len(alone.tokens) - 1}"
    got = core.tokens[request_id]
    if r["abort"] is not None:
        tokens = tokens[: len(got)]
    assert got == tokens, what
    if r["params"].logprobs is not None:
        rows = core.logprobs[request_id]
        assert len(rows) == len(got), f"{what}: {len(rows)} logprob rows for {len(got)} tokens"
        for i, (row, want) in enumerate(zip(rows, alone.logprobs[alone_id])):
            assert row[0][0] == got[i], f"{what}: row {i} is not its token's"
            _assert_same_row(row, want, f"{what} token {i}")
    if r["params"].prompt_logprobs is not None and r["abort"] is None:
        seen, want = core.prompt_logprobs[request_id], alone.prompt_logprobs[alone_id]
        assert sorted(seen) == list(range(1, len(r["prompt"]))), f"{what}: prompt rows at {sorted(seen)}"
        for position, row in seen.items():
            _assert_same_row(row, want[position], f"{what} prompt token {position}")


# Drawn for their reach, both with overlapped steps: 60_013 preempts by recompute with prefix caching (26 preemptions;
# 205 prompt-logprob rows computed again), 60_003 by swap (12 preemptions).
@pytest.mark.parametrize("seed, recomputes", [(60_013, True), (60_003, False)])
def test_logprobs_and_constraints_equal_one_request_at_a_time_on_replayable_schedules(tiny_llama: str, seed: int,
                                                                                      recomputes: bool) -> None:
    rng = random.Random(seed)
    config, core, alone = sampling_cores(tiny_llama, rng, RecordingCore)
    try:
        pool = _pool(rng)
        for k in range(2):
            for r in _round(core, rng, pool, f"r{k}", True, False, draw=_draw):
                _check(r, core, alone, f"seed {seed} {config} round {k} {r['id']} (prompt of {len(r['prompt'])}, "
                                       f"abort after {r['abort']}): {r['params']}")
        assert core.core.scheduler.get_stats().num_preemptions_total > 0, "the draw should preempt"
        assert (core.rows_computed_again > 0) == recomputes, "a recomputed prefill should send its prompt rows again"
    finally:
        core.close()
        alone.close()
