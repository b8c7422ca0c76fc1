"""`beam_search` over a scripted engine (fixed next-token logprobs): vLLM's score, the generation config's suppressed
ids, the stop at max_model_len, a step ending without a token, and the parameters and prompts it refuses."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest

from asyncllm import BeamSearchParams, InvalidRequestError
from asyncllm.beam_search import beam_max_tokens, beam_search
from asyncllm.errors import EngineDeadError, NotBuiltError, RequestTimeoutError
from asyncllm.generation_config import SuppressedTokens
from asyncllm.outputs import Logprob

EOS, A, B, C, D = 1, 10, 11, 12, 13
TABLE = {  # the last token -> every next token's (raw) logprob
    5: {A: -0.1, EOS: -2.0, B: -3.0, C: -4.0, D: -5.0},
    A: {A: -3.0, EOS: -5.0, B: -6.0, C: -7.0, D: -8.0},
    B: {B: -0.5, A: -1.0, C: -2.0, EOS: -9.0, D: -9.5},
    C: {C: -0.2, A: -1.5, B: -2.5, EOS: -9.0, D: -9.5},
    EOS: {B: -0.3, A: -0.4, C: -3.0, EOS: -6.0, D: -7.0},
}


class _Engine:
    """Answers each step's request from `TABLE` (its top ``params.logprobs``, ranked); refuses, as the engine does, a
    request past `max_model_len`; keeps every request's params."""

    tokenizer = None
    eos_token_ids = [EOS]

    def __init__(self, max_model_len: int = 64, suppressed: SuppressedTokens = SuppressedTokens(),
                 finish_reason: str | None = None) -> None:
        self.config = SimpleNamespace(max_logprobs=20, max_model_len=max_model_len)
        self.suppressed_tokens = suppressed
        self.finish_reason = finish_reason
        self.params: list[Any] = []

    async def start(self) -> None:
        return None

    async def generate(self, tokens: list[int], params: Any, **options: Any) -> Any:
        assert len(tokens) < self.config.max_model_len, "the engine refuses a prompt that leaves no room"
        self.params.append(params)
        if self.finish_reason is not None:
            return SimpleNamespace(outputs=[SimpleNamespace(logprobs=None, finish_reason=self.finish_reason)])
        ranked = sorted(TABLE[tokens[-1]].items(), key=lambda item: -item[1])[:params.logprobs]
        entry = {token: Logprob(value, rank + 1) for rank, (token, value) in enumerate(ranked)}
        return SimpleNamespace(outputs=[SimpleNamespace(logprobs=[entry], finish_reason="length")])


def _search(engine: _Engine, prompt: Any, **fields: Any) -> Any:
    params = BeamSearchParams(**{"beam_width": 1, "max_tokens": 2, **fields})
    return asyncio.run(beam_search(engine, prompt, params))  # type: ignore[arg-type]


def test_an_eos_ending_beams_length_leaves_the_eos_out() -> None:
    """vLLM's get_beam_search_score: [5, EOS] scores -2.0 / 1, not -2.0 / 2, so the live [5, A, A] (-3.1 / 3) wins."""
    out = _search(_Engine(), [5])
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [([5, A, A], "length")]


def test_suppressed_ids_are_never_candidates_and_keep_no_share_of_the_logprob() -> None:
    """suppress_tokens (A) at every step, begin_suppress_tokens (B) at the first: transformers' masks over the
    log-softmax scores, so the others keep their raw logprobs (not renormalised)."""
    engine = _Engine(suppressed=SuppressedTokens(frozenset({A}), frozenset({B}), vocab_size=512))
    out = _search(engine, [5], beam_width=2, max_tokens=2, ignore_eos=True)
    assert [s.tokens for s in out.sequences] == [[5, EOS, B], [5, C, C]]  # raw: [5, A, A] and [5, EOS, B]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([-2.3, -4.2])
    first, second = out.sequences[0].logprobs
    assert list(first) == [EOS, C, D] and first[C] == Logprob(-4.0, 4)  # the raw value and rank
    assert list(second) == [B, C, EOS, D]  # B may come after the first step, A never
    assert [p.logprobs for p in engine.params] == [4 + 2, 4 + 1, 4 + 1]  # 2 * width and one per id left out


def test_a_search_stops_where_max_model_len_leaves_no_room() -> None:
    """A 2-token prompt at max_model_len 4: two steps, not max_tokens, the beams ending with 'length'."""
    out = _search(_Engine(max_model_len=4), [5, A], max_tokens=100, ignore_eos=True)
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [([5, A, A, A], "length")]
    with pytest.raises(InvalidRequestError, match="maximum context length is 4 tokens") as info:
        _search(_Engine(max_model_len=4), [5, A, A, A])
    assert info.value.field == "prompt"
    assert beam_max_tokens(64, 5, 100) == 59 and beam_max_tokens(64, 5, 3) == 3 and beam_max_tokens(64, 5, None) == 59


@pytest.mark.parametrize("finish_reason, error", [("timeout", RequestTimeoutError), ("abort", EngineDeadError)])
def test_a_step_ending_without_a_token_ends_the_search(finish_reason: str, error: type) -> None:
    with pytest.raises(error, match=finish_reason):
        _search(_Engine(finish_reason=finish_reason), [5])


@pytest.mark.parametrize("fields, field", [
    ({"length_penalty": "x"}, "length_penalty"), ({"length_penalty": math.nan}, "length_penalty"),
    ({"length_penalty": math.inf}, "length_penalty"), ({"length_penalty": True}, "length_penalty"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"beam_width": True}, "beam_width"), ({"max_tokens": True}, "max_tokens"),
])
def test_a_bad_parameter_is_named(fields: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _search(_Engine(), [5], **fields)
    assert info.value.field == field


def test_prompts_it_takes_and_refuses() -> None:
    assert _search(_Engine(), (5,)).sequences[0].tokens == [5, A, A]  # a tuple is token ids, as generate's
    for prompt in (12345, None, 1.5, ""):
        with pytest.raises(InvalidRequestError) as info:
            _search(_Engine(), prompt)
        assert info.value.field == "prompt"
    for prompts in (["hi", "there"], [{"prompt": "hi"}], [[5], [6]], ((5,), (6,))):
        with pytest.raises(InvalidRequestError, match="one prompt per call"):
            _search(_Engine(), prompts)
    with pytest.raises(NotBuiltError, match="beam search over an encoder-decoder prompt"):
        _search(_Engine(), {"encoder_prompt": {"prompt": "", "multi_modal_data": {}}, "decoder_prompt": "hi"})


class _Tokenizer:
    """Decodes ids as their numbers; no id is special, as a generation config's extra EOS id (say a newline's)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def test_a_beam_that_ended_with_eos_leaves_it_out_of_its_text() -> None:
    """vLLM's beam search decodes a beam ending in EOS without it (as generate's text leaves its stop token out), not
    only when skip_special_tokens would drop it: an EOS id need not be a special token. ignore_eos: it is text."""
    engine = _Engine()
    engine.tokenizer = _Tokenizer()
    out = _search(engine, [5], beam_width=3, max_tokens=1)
    assert [(s.tokens, s.finish_reason, s.text) for s in out.sequences] == [
        ([5, A], "length", str(A)), ([5, B], "length", str(B)), ([5, EOS], "stop", "")]
    out = _search(engine, [5], beam_width=2, max_tokens=1, ignore_eos=True, length_penalty=0.0)
    assert [(s.tokens, s.finish_reason, s.text) for s in out.sequences] == [
        ([5, A], "length", str(A)), ([5, EOS], "length", str(EOS))]
