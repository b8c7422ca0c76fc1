"""`AsyncEngine.beam_search` (vLLM's ``LLM.beam_search``) against transformers' beam search."""

from __future__ import annotations

import pytest
import torch

from asyncllm import AsyncEngine, BeamSearchParams, InvalidRequestError
from asyncllm.generation_config import SuppressedTokens
from engine_helpers import random_prompts
from hf_reference import _hf_model

SOURCE = ("generation_config", "generation_config.json")  # the field a ConfigError names, and its file


def _hf_beams(path: str, prompt: list[int], width: int, max_tokens: int, no_eos: int,
              **rules: list[int]) -> list[list[int]]:
    """transformers' beams, best first, with an EOS id that never comes up (so no beam ends early); `rules`:
    suppress_tokens / begin_suppress_tokens."""
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                             length_penalty=1.0, eos_token_id=no_eos, pad_token_id=no_eos, **rules)
    return [row[len(prompt):].tolist() for row in out]


async def test_beams_equal_transformers_when_no_beam_ends(tiny_llama: str) -> None:
    width, max_tokens = 3, 8
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    async with AsyncEngine(tiny_llama, disable_log_stats=True) as engine:
        for prompt in random_prompts(3, seed=11):
            out = await engine.beam_search(prompt, params)
            got = [seq.tokens[len(prompt):] for seq in out.sequences]
            no_eos = max(engine.tokenizer.get_vocab().values())  # an id far down every candidate list
            assert all(no_eos not in tokens for tokens in got)
            assert got == _hf_beams(tiny_llama, prompt, width, max_tokens, no_eos)
            scores = [seq.cum_logprob / len(seq.tokens) for seq in out.sequences]
            assert scores == sorted(scores, reverse=True)
            assert all(seq.finish_reason == "length" and seq.num_output_tokens == max_tokens for seq in out.sequences)
            assert out.sequences[0].text == engine.tokenizer.decode(got[0], skip_special_tokens=True)
            for seq in out.sequences:  # vLLM's entries: each step's top 2 * width, the chosen token among them
                assert all(len(entry) == 2 * width for entry in seq.logprobs)
                assert [sorted(lp.rank for lp in entry.values()) for entry in seq.logprobs] == \
                    [list(range(1, 2 * width + 1))] * max_tokens
                assert sum(seq.token_logprobs) == pytest.approx(seq.cum_logprob)
        prompt = random_prompts(1, seed=12)[0]
        best = (await engine.beam_search(prompt, params)).sequences[0].tokens[len(prompt):]
        await _obeys_suppressed_ids_as_transformers(engine, tiny_llama, prompt, best, no_eos)
        engine.eos_token_ids = [best[2]]  # a token the best beam takes: candidates ending in it complete
        out = await engine.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
        stopped = [seq for seq in out.sequences if seq.finish_reason == "stop"]
        assert stopped and all(seq.tokens[-1] == best[2] and seq.num_output_tokens <= max_tokens for seq in stopped)
        assert all(seq.text == engine.tokenizer.decode(seq.tokens[len(prompt):-1], skip_special_tokens=True)
                   for seq in stopped)  # vLLM's: the (here not special) EOS that ended a beam is no text
        scores = [seq.cum_logprob / (len(seq.tokens) - (seq.finish_reason == "stop")) for seq in out.sequences]
        assert scores == sorted(scores, reverse=True) and len(out.sequences) == width
        text = await engine.beam_search("def add(a, b):", BeamSearchParams(beam_width=2, max_tokens=4))
        assert len(text.sequences) == 2 and all(s.cum_logprob < 0 for s in text.sequences)
        as_dicts = [await engine.beam_search(p, BeamSearchParams(beam_width=2, max_tokens=4))
                    for p in ({"prompt": "def add(a, b):"}, {"prompt_token_ids": text.sequences[0].tokens[:-4]},
                              {"prompt": "def add(a, b):", "images": None, "multi_modal_data": {"image": []}})]
        assert [d.sequences[0].tokens for d in as_dicts] == [text.sequences[0].tokens] * 3  # vLLM's prompt dicts
        for bad, field in (({"prompt": "hi", "images": [b"x"]}, "prompt.images"), ({}, "prompt"),
                           ({"prompt": [1, 2]}, "prompt.prompt"), ({"prompt_token_ids": "hi"}, "prompt.prompt_token_ids"),
                           ({"prompt": "hi", "images": None, "videos": [b"x"]}, "prompt.videos"),
                           ({"prompt": "hi", "prompt_token_ids": [5]}, "prompt")):
            with pytest.raises(InvalidRequestError) as info:
                await engine.beam_search(bad, params)
            assert info.value.field == field
        for bad, field in ((BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
                           *((BeamSearchParams(beam_width=2, max_tokens=4, temperature=t), "temperature")
                             for t in (-0.5, float("nan"), float("inf"), True))):
            with pytest.raises(InvalidRequestError) as info:
                await engine.beam_search([5, 6, 7], bad)
            assert info.value.field == field
        # as vLLM's under raw_logprobs: a temperature changes no beam
        warm = await engine.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                                 temperature=0.7))
        assert [s.tokens for s in warm.sequences] == [s.tokens for s in out.sequences]
        assert [s.cum_logprob for s in warm.sequences] == pytest.approx([s.cum_logprob for s in out.sequences])
        with pytest.raises(InvalidRequestError, match="request_id"):
            await engine.beam_search([5, 6, 7], params, request_id="mine")



async def _obeys_suppressed_ids_as_transformers(engine: AsyncEngine, path: str, prompt: list[int], best: list[int],
                                                no_eos: int) -> None:
    """generation_config.json's suppress_tokens (every step) and begin_suppress_tokens (the first step), here ids
    the unruled best beam takes: left out as transformers' num_beams search leaves them out."""
    assert engine.suppressed_tokens == SuppressedTokens(vocab_size=engine.suppressed_tokens.vocab_size)  # it has none
    rules = {"begin_suppress_tokens": [best[0]], "suppress_tokens": [next(t for t in best[1:] if t != best[0])]}
    engine.suppressed_tokens = SuppressedTokens.of(rules, engine.suppressed_tokens.vocab_size, SOURCE)
    try:
        out = await engine.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    finally:
        engine.suppressed_tokens = SuppressedTokens(vocab_size=engine.suppressed_tokens.vocab_size)
    got = [seq.tokens[len(prompt):] for seq in out.sequences]
    assert all(tokens[0] != best[0] and rules["suppress_tokens"][0] not in tokens for tokens in got)
    assert got == _hf_beams(path, prompt, 2, 4, no_eos, **rules)


async def test_an_invalid_beam_search_is_refused_before_the_engine_starts(tiny_llama: str) -> None:
    """Its parameters and a caller's request_id are checked first, as any request's: no model load, no core."""
    engine = AsyncEngine(tiny_llama, disable_log_stats=True)
    try:
        with pytest.raises(InvalidRequestError, match="request_id"):
            await engine.beam_search([5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=4), request_id="mine")
        with pytest.raises(InvalidRequestError):
            await engine.beam_search([5, 6, 7], BeamSearchParams(beam_width=0, max_tokens=4))
        assert not engine.started
    finally:
        await engine.aclose()


def test_numpy_scalars_are_taken_as_python_numbers() -> None:
    """An ``np.float32`` temperature (a numpy sweep's) and ``np.int64`` sizes, as `SamplingParams` takes them."""
    import numpy as np

    params = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int32(4), temperature=np.float32(0.5),
                              length_penalty=np.float64(1.5))
    params.validate()
    assert [type(v) for v in (params.beam_width, params.max_tokens, params.temperature, params.length_penalty)] \
        == [int, int, float, float]
    with pytest.raises(InvalidRequestError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=np.float32("nan")).validate()
