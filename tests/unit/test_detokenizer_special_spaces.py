"""``spaces_between_special_tokens``: vLLM's rule for adjacent added tokens, streamed exactly."""

from __future__ import annotations

import msgspec
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncllm.engine.detokenizer import IncrementalDetokenizer
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams
from test_detokenizer import SlowTokenizerView

TOKENS = ["hello", "[CLS]", "[SEP]", "<tool>", "world", "##s", "[SEP]", "<tool>", "."]
JOINED = "hello [CLS][SEP]<tool> worlds [SEP]<tool>."
"""vLLM's text with False: an added token right after another loses the decoder's space; one after a word keeps it."""


@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerFast:
    """A BERT-like tokenizer whose WordPiece decoder puts a space before every added token, special or not."""
    vocab = {token: i for i, token in enumerate(["[UNK]", "hello", "world", "##s", "."])}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["[CLS]", "[SEP]"])
    backend.add_tokens(["<tool>"])  # an added token that is not special
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)


def _text(tokenizer, ids: list[int], batch: int, **fields) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(**fields))
    for start in range(0, len(ids), batch):
        detokenizer.update(ids[start:start + batch], finished=start + batch >= len(ids))
    return detokenizer.output_text


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_false_joins_adjacent_added_tokens_and_streams_exactly(wordpiece, path) -> None:
    tokenizer = wordpiece if path == "fast" else SlowTokenizerView(wordpiece)
    ids = wordpiece.convert_tokens_to_ids(TOKENS)
    decoded = wordpiece.decode(ids, skip_special_tokens=False)
    assert decoded == "hello [CLS] [SEP] <tool> worlds [SEP] <tool>."
    for batch in (1, 3, len(ids)):  # token by token, in updates of 3, in one update
        assert _text(tokenizer, ids, batch, skip_special_tokens=False) == decoded  # True: the decoder's own text
        assert _text(tokenizer, ids, batch, skip_special_tokens=False, spaces_between_special_tokens=False) == JOINED


def test_skip_special_tokens_ignores_the_flag(wordpiece) -> None:
    ids = wordpiece.convert_tokens_to_ids(TOKENS)
    kept = "hello <tool> worlds <tool>."  # the non-special added token keeps its spaces, as in vLLM
    assert wordpiece.decode(ids, skip_special_tokens=True) == kept
    assert {_text(wordpiece, ids, 1, spaces_between_special_tokens=flag) for flag in (True, False)} == {kept}


def test_the_field_is_a_validated_bool_that_crosses_the_wire() -> None:
    params = SamplingParams(spaces_between_special_tokens=False)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert SamplingParams().spaces_between_special_tokens is True
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(spaces_between_special_tokens="no").validate()
    assert error.value.field == "spaces_between_special_tokens"
