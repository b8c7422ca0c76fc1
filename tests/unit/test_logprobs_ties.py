"""Host-side logprobs rows: a sampled token tied with another takes its rank as vLLM's logprobs dict gives it;
``decoded_token`` is vLLM V1's for byte tokens (the character on its last byte, "" before) and SentencePiece
pieces (their leading spaces kept)."""

from __future__ import annotations

import numpy as np
import pytest
from test_detokenizer import sentencepiece_style_tokenizer
from tokenizers import pre_tokenizers

from asyncllm.engine.logprobs import LogprobsDecoder, PromptLogprobsBuffer
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


def _llama_tokenizer(metaspace: bool):
    """Byte fallback with the Llama 2 decoder chain; `metaspace`: the pre-tokenizer of converted Mistral / Llama
    (legacy=False) tokenizers, else Llama 2's Prepend/Replace normalizer (vLLM reads no leading-space marks there)."""
    tokenizer = sentencepiece_style_tokenizer("llama2")
    if metaspace:
        backend = tokenizer.backend_tokenizer
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    return tokenizer


def _rows(ids: list[list[int]], start: int = 0):
    ids_array = np.array(ids)
    return pack_logprobs(ids_array, np.zeros(ids_array.shape, np.float32), np.ones(len(ids)), start)


def _texts(rows: list) -> list[list[str]]:
    return [[lp.decoded_token for lp in row.values()] for row in rows]


@pytest.mark.parametrize("metaspace", [True, False])
def test_byte_tokens_name_their_character_on_its_last_byte(metaspace: bool) -> None:
    """vLLM's LogprobsProcessor: 'hello€ the' sampled in two deltas (the second row's context comes from the first
    delta) is ' ', 'he', 'llo', '', '', '€', ' the' (without the Metaspace pre-tokenizer '', ..., 'the'); a top-N
    byte token is repaired against the same sampled tokens: '' (<0x83> after <0xE2> ends no character)."""
    tokenizer = _llama_tokenizer(metaspace)
    ids = tokenizer.convert_tokens_to_ids(["\u2581", "he", "llo", "<0xE2>", "<0x82>", "<0xAC>", "\u2581the"])
    alternative, bare = tokenizer.convert_tokens_to_ids(["<0x83>", "the"])
    decoder = LogprobsDecoder(tokenizer)
    first = decoder.decode(_rows([[ids[0], bare]] + [[i, i] for i in ids[1:4]]))
    second = decoder.decode(_rows([[ids[4], alternative], [ids[5], ids[5]], [ids[6], bare]]), preceding=ids[:4])
    space = " " if metaspace else ""
    names = [[space, "the"], ["he"], ["llo"], [""], ["", ""], ["\u20ac"], [space + "the", "the"]]
    assert _texts(first + second) == names
    assert decoder.decode(_rows([[ids[5], ids[5]]]), preceding=ids[:5]) == second[1:2]  # the cache keeps no byte text
    assert decoder.decode(_rows([[ids[5], ids[5]]]))[0][ids[5]].decoded_token == ""  # no context: incomplete


def test_prompt_rows_take_the_prompt_tokens_before_them_across_chunks() -> None:
    """Prompt logprobs come in prefill chunks: the row of <0xAC> (position 4) finds <0xE2><0x82> in the rows of
    the chunk before. As vLLM, prompt token 0 (no row) is no context: a prompt opening with <0xE2> never shows '€'."""
    tokenizer = _llama_tokenizer(metaspace=True)
    prompt = tokenizer.convert_tokens_to_ids(["<s>", "\u2581the", "<0xE2>", "<0x82>", "<0xAC>", "\u2581"])
    buffer, decoder = PromptLogprobsBuffer(len(prompt)), LogprobsDecoder(tokenizer)
    buffer.add(_rows([[t] for t in prompt[1:4]], start=1), decoder)
    buffer.add(_rows([[t] for t in prompt[4:]], start=4), decoder)
    assert [row and _texts([row])[0] for row in buffer.entries] == [None, [" the"], [""], [""], ["\u20ac"], [" "]]
    headless = PromptLogprobsBuffer(3)
    headless.add(_rows([[t] for t in prompt[3:5]], start=1), decoder)
    assert _texts(headless.entries[1:]) == [[""], [""]]
