"""Which folders load with mistral_common, what a missing mistral_common says, and ids past the vocabulary
(asyncllm/mistral_tokenizer.py, docs/tokenizers.md)."""

from __future__ import annotations

import os
import sys

import pytest

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mistral_tokenizer import is_mistral, load_mistral_tokenizer, uses_mistral
from asyncllm.tokenizer import load_tokenizer
from mistral_utils import write_tekken


def _folder(tmp_path, *names: str) -> str:
    for name in names:
        (tmp_path / name).write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("names, mode, expected", [
    (("tekken.json",), "auto", True),
    (("tokenizer.model.v3",), "auto", True),
    (("tokenizer.mm.model.v7m1",), "auto", True),
    (("tekken.json", "tokenizer.json"), "auto", False),
    (("tekken.json", "tokenizer_config.json"), "auto", False),
    (("tokenizer.model",), "auto", False),
    (("tokenizer.json",), "auto", False),
    (("tekken.json",), "hf", False),
    (("tekken.json",), "slow", False),
    (("tokenizer.json",), "mistral", True),
])
def test_which_folders_load_with_mistral_common(tmp_path, names, mode, expected) -> None:
    assert uses_mistral(_folder(tmp_path, *names), mode) is expected


def test_a_hub_id_takes_auto_as_hugging_faces() -> None:
    assert not uses_mistral("mistralai/Some-Model", "auto") and uses_mistral("mistralai/Some-Model", "mistral")


def test_a_missing_mistral_common_names_the_extra(tmp_path, monkeypatch) -> None:
    from transformers.utils.import_utils import is_mistral_common_available

    assert is_mistral_common_available()  # cached now: transformers' own check never sees the hidden package
    monkeypatch.setitem(sys.modules, "mistral_common", None)
    with pytest.raises(ConfigError, match=r"asyncllm\[mistral\]") as raised:
        load_tokenizer(_folder(tmp_path, "tekken.json"))
    assert raised.value.field == "tokenizer_mode"


def test_a_folder_without_a_mistral_file_is_a_config_error(tiny_llama: str) -> None:
    with pytest.raises(ConfigError, match="tekken.json") as raised:
        load_tokenizer(tiny_llama, mode="mistral")
    assert raised.value.field == "tokenizer"


def test_auto_loads_tekken_with_its_control_tokens(tmp_path) -> None:
    tokenizer = load_tokenizer(write_tekken(str(tmp_path)))
    assert is_mistral(tokenizer) and (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    ids = tokenizer("[INST] Beautiful").input_ids
    assert ids[0] == 1 and 3 not in ids and tokenizer.decode(ids, skip_special_tokens=True) == "[INST] Beautiful"


def test_ids_past_the_vocabulary_decode_to_nothing(tmp_path) -> None:
    tokenizer = load_mistral_tokenizer(write_tekken(str(tmp_path), num_merges=20))
    assert tokenizer.vocab_size == 376
    word = tokenizer("Beautiful", add_special_tokens=False).input_ids
    assert tokenizer.decode([*word, 376, 9999]) == tokenizer.decode(word) == "Beautiful"
    assert tokenizer.convert_ids_to_tokens([word[0], 400]) == [tokenizer.convert_ids_to_tokens(word[0]), ""]


def test_a_model_with_media_is_refused_under_mistral(tmp_path) -> None:
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from mm_utils import make_tiny_llava

    llava = make_tiny_llava(tmp_path / "llava")
    write_tekken(llava)
    assert os.path.isfile(os.path.join(llava, "tekken.json"))
    with pytest.raises(NotBuiltError, match="mistral_common's tokenizer for LlavaForConditionalGeneration"):
        prepare(EngineConfig.create(llava, tokenizer_mode="mistral"))


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_a_tool_call_streams_with_its_control_tokens_kept(tmp_path, chunk: int, spaces: bool) -> None:
    """The mistral tool parser reads ``[TOOL_CALLS]name[ARGS]{...}``: the server keeps special tokens for it (with
    ``spaces_between_special_tokens`` False too: the control tokens are the tokenizer's added tokens)."""
    from asyncllm import SamplingParams
    from asyncllm.engine.detokenizer import IncrementalDetokenizer

    tokenizer = load_tokenizer(write_tekken(str(tmp_path)))
    text = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    ids = [9, *text("get_weather"), 20, *text('{"city": "Paris"}')]
    for skip, expected in ((False, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
                           (True, 'get_weather{"city": "Paris"}')):
        detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=skip,
                                                                      spaces_between_special_tokens=spaces))
        deltas = [detok.update(ids[i:i + chunk], False).text for i in range(0, len(ids), chunk)]
        assert "".join(deltas) + detok.update([], True).text == expected


def test_a_lowercased_chat_is_refused_under_mistral(tmp_path) -> None:
    """A lowercasing embedding model renders its chat as text first (vLLM's); mistral_common's ids cannot be."""
    from asyncllm.tokenizer import render_chat

    tokenizer = load_tokenizer(write_tekken(str(tmp_path)))
    with pytest.raises(NotBuiltError, match="lowercasing"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}], lower=True)
    assert render_chat(tokenizer, [{"role": "user", "content": "Hi"}]).token_ids[:2] == [1, 3]
