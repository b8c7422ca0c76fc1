"""Tokenizer loading, prompt encoding, chat templates and EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.generation_config import read_generation_config
from asyncllm.tiny import make_tiny_checkpoint
from asyncllm.tokenizer import (
    apply_chat_template, bad_words_token_ids, encode_prompt, eos_token_ids, load_chat_template, load_tokenizer,
    template_messages,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_path: str) -> Any:
    return load_tokenizer(tiny_path)


def _word_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer with no BOS and no chat template."""
    backend = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", name_or_path="word-level")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_load_tokenizer_failure_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(tmp_path))
    assert info.value.field == "tokenizer"
    assert info.value.value == str(tmp_path)


def test_encode_prompt_adds_bos_like_hf(tokenizer: Any) -> None:
    assert encode_prompt(tokenizer, "héllo 🙂") == [0, *_ids(tokenizer, "héllo 🙂")]
    assert encode_prompt(tokenizer, "") == [0]
    assert encode_prompt(_word_level_tokenizer(), "hello world") == [0, 1]


def test_encode_prompt_rejects_non_str_and_empty_encodings(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        encode_prompt(tokenizer, [1, 2])  # type: ignore[arg-type]
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match="no tokens"):
        encode_prompt(_word_level_tokenizer(), "")


def test_chat_template_renders_exact_ids(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    expected = [0, 5, *_ids(tokenizer, "Be brief."), 1, 3, *_ids(tokenizer, "Hi ✓"), 1]
    assert apply_chat_template(tokenizer, messages) == [*expected, 4]
    assert apply_chat_template(tokenizer, messages, add_generation_prompt=False) == expected
    text = "<|bos|><|system|>Be brief.<|eos|><|user|>Hi ✓<|eos|><|assistant|>"
    assert apply_chat_template(tokenizer, messages) == _ids(tokenizer, text)


def test_chat_template_extra_message_keys_are_allowed(tokenizer: Any) -> None:
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "x", "name": "bob"}])
    assert ids == [0, 3, *_ids(tokenizer, "x"), 1, 4]


def test_missing_chat_template_is_invalid_request() -> None:
    with pytest.raises(InvalidRequestError) as info:
        apply_chat_template(_word_level_tokenizer(), [{"role": "user", "content": "hello"}])
    assert info.value.field == "messages"
    assert "word-level has no chat template" in str(info.value)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": 1, "content": "hi"}],
        ({"role": "user", "content": "hi"},),
    ],
)
def test_malformed_messages_are_invalid_request(tokenizer: Any, messages: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        apply_chat_template(tokenizer, messages)
    assert info.value.field == "messages"


def test_template_exception_is_invalid_request(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError, match="unknown role: robot"):
        apply_chat_template(tokenizer, [{"role": "robot", "content": "{}"}])
    for template, kind in [("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ messages[0]['content'] + 1 }}", "TypeError")]:
        with pytest.raises(InvalidRequestError, match=rf"could not be tokenized \({kind}: ") as info:  # as vLLM: 400
            apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)
        assert info.value.field == "messages"


def test_tool_call_arguments_parsed_as_vllm() -> None:
    """vLLM's ``_postprocess_messages``: JSON text as the value it holds (any), text that is not JSON as {}, a dict
    or list kept, anything else (None, a number) as {}."""
    def parsed(arguments: object) -> object:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])[0][
            "tool_calls"][0]["function"]["arguments"]

    given = ("[1, 2]", [1, 2], '{"a": 1}', {"a": 1}, None, "", [], "5", '"x"', "null", '{"a": 1', "not json", 5, 1.5)
    assert [parsed(a) for a in given] == [
        [1, 2], [1, 2], {"a": 1}, {"a": 1}, {}, {}, [], 5, "x", None, {}, {}, {}, {}]


def test_empty_tool_calls_dropped_as_vllm(tokenizer: Any) -> None:
    """An assistant's ``tool_calls: []`` is dropped (vLLM's ``_postprocess_messages``), so a template testing
    ``'tool_calls' in message`` (Llama 3.1's) renders a plain assistant turn."""
    template = ("{% for m in messages %}{% if 'tool_calls' in m %}{{ raise_exception('single calls only') }}"
                "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert template_messages(messages)[1] == {"role": "assistant", "content": ""}
    plain = [messages[0], {"role": "assistant", "content": ""}]
    assert apply_chat_template(tokenizer, messages, chat_template=template) == \
        apply_chat_template(tokenizer, plain, chat_template=template)


def _with_generation_config(tiny_path: str, tmp_path: Path, eos: object) -> str:
    folder = tmp_path / "model"
    shutil.copytree(tiny_path, folder)
    if eos is None:
        (folder / "generation_config.json").unlink()
    else:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return str(folder)


def _generation(folder: str) -> dict[str, Any]:
    return read_generation_config("auto", folder)


@pytest.mark.parametrize(
    ("eos", "expected"),
    [(None, [1]), (1, [1]), (7, [1, 7]), ([7, 1, 9, 7], [1, 7, 9]), ([], [1])],
)
def test_eos_ids_merge_generation_config(tokenizer: Any, tiny_path: str, tmp_path: Path, eos: object,
                                         expected: list[int]) -> None:
    assert eos_token_ids(tokenizer, _generation(_with_generation_config(tiny_path, tmp_path, eos))) == expected


def test_eos_ids_without_tokenizer_eos(tiny_path: str, tmp_path: Path) -> None:
    folder = _with_generation_config(tiny_path, tmp_path, [5, 3])
    assert eos_token_ids(_word_level_tokenizer(), _generation(folder)) == [5, 3]


def test_eos_ids_of_the_tiny_checkpoint(tokenizer: Any, tiny_path: str) -> None:
    assert eos_token_ids(tokenizer, _generation(tiny_path)) == [1]


def test_unreadable_generation_config_is_config_error(tokenizer: Any, tiny_path: str, tmp_path: Path) -> None:
    folder = _with_generation_config(tiny_path, tmp_path, 1)
    Path(folder, "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        eos_token_ids(tokenizer, _generation(folder))
    assert info.value.field == "model"


def test_chat_template_flag_value(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template, encoding="utf-8")
    assert load_chat_template(str(path)) == template and load_chat_template(template) == template
    # vLLM's rule: no file, and a "{", "}" or newline: the text, as is (no unicode_escape, as vLLM's since #15143)
    for text in ("User:\nAssistant:", "}", r"{{ m }}\n é"):
        assert load_chat_template(text) == text
    with pytest.raises(ConfigError, match="chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "latin1.jinja").write_bytes(b"{{ m }}\xe9\xff")  # not UTF-8: one line, not a traceback
    with pytest.raises(ConfigError, match="a UTF-8 text file"):
        load_chat_template(str(tmp_path / "latin1.jinja"))


def test_a_cut_text_is_the_tokenizers_own_as_vllm_sets_its_side(tokenizer: Any, tiny_path: str) -> None:
    """``truncation=True, max_length=k`` on vLLM's side: "left" for a generation (BOS, then the text's last
    k - 1 tokens), "right" for pooling; the shared tokenizer's own setting is left alone."""
    from transformers import AutoTokenizer

    text = "def area(r):\n    return 3.14 * r * r\n" * 3
    ids = tokenizer(text).input_ids
    sides = {side: AutoTokenizer.from_pretrained(tiny_path, truncation_side=side) for side in ("left", "right")}
    for k in (2, 5, len(ids) + 1):
        for side, reference in sides.items():
            assert encode_prompt(tokenizer, text, max_length=k, truncation_side=side) == reference(
                text, truncation=True, max_length=k).input_ids
    assert encode_prompt(tokenizer, text, max_length=5) == ids[:1] + ids[-4:]
    assert tokenizer.truncation_side == "right" and tokenizer.backend_tokenizer.truncation is None
    for side, reference in sides.items():  # k = the special tokens: BOS alone, as HF's (and vLLM's)
        assert encode_prompt(tokenizer, text, max_length=1, truncation_side=side) == reference(
            text, truncation=True, max_length=1).input_ids == ids[:1]


def test_a_cut_without_special_tokens_reserves_no_room_for_them() -> None:
    """``add_special_tokens=False``: no [CLS] / [SEP] to keep, so k = 1 keeps the text's last token, as HF's (and
    vLLM's); with them, a k below the 2 they take stays an error."""
    from tokenizers import processors

    backend = Tokenizer(models.WordLevel({"[CLS]": 0, "[SEP]": 1, "a": 2, "b": 3, "c": 4}, unk_token="[CLS]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 0), ("[SEP]", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]")
    assert encode_prompt(tokenizer, "a b c", add_special_tokens=False, max_length=1) == [4]
    assert encode_prompt(tokenizer, "a b c", add_special_tokens=False, max_length=2, truncation_side="right") == [2, 3]
    with pytest.raises(InvalidRequestError, match="keep at least 2"):
        encode_prompt(tokenizer, "a b c", max_length=1)


def test_truncating_copies_lock_apart(tokenizer: Any) -> None:
    """Each side's copy has its own lock, held while its caller encodes; the global one only while finding it, so
    an encode on the other side runs meanwhile (the whole encode under one lock serialised every thread)."""
    import threading

    from asyncllm.tokenizer import truncating

    done = threading.Event()

    def encode_right() -> None:
        with truncating(tokenizer, 3, "right") as cutting:
            cutting("a b c d e f", truncation=True, max_length=3)
        done.set()

    with truncating(tokenizer, 3, "left"):
        threading.Thread(target=encode_right, daemon=True).start()
        assert done.wait(2.0)


def test_prompt_tokenizer_cuts_text_chat_and_token_ids_as_vllm(tokenizer: Any) -> None:
    """A generation's text prompt keeps BOS and the last k - 1 tokens; token ids and a rendered chat (no special
    tokens added to it) keep their last k; a pooling request's text keeps its start."""
    from asyncllm.engine.collector import RequestCollector
    from asyncllm.engine.processor import Submit
    from asyncllm.engine.prompt_tokens import PromptTokenizer
    from asyncllm.engine.stream import RequestOptions
    from asyncllm.pooling import PoolingParams
    from asyncllm.sampling import SamplingParams

    prompts = PromptTokenizer(tokenizer, len(tokenizer))
    prompts.ready(64)
    text = "import os\nimport sys\n" * 4
    ids, messages = tokenizer(text).input_ids, [{"role": "user", "content": text}]
    chat = apply_chat_template(tokenizer, messages)

    def cut(prompt: Any, is_chat: bool = False, **options: Any) -> list[int]:
        job = Submit(RequestCollector("r", 0.0), prompt, SamplingParams(truncate_prompt_tokens=6),
                     RequestOptions(**options), is_chat)
        return prompts.token_ids(job)

    assert cut(text) == ids[:1] + ids[-5:]
    assert cut(ids) == ids[-6:] and cut(messages, True) == chat[-6:]
    assert cut(text, pooling=PoolingParams()) == ids[:6]


class _CountingTokenizer:
    """One token per character, ids by character, a leading space joined to a letter after it (id + 1000, BPE's
    "Ġa") but not to a digit (SentencePiece's "▁" before a digit); counts its encodes."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        if text[:1] == " " and text[1:2].isalpha():
            return [1000 + ord(text[1])] + [ord(c) for c in text[2:]]
        return [ord(c) for c in text]


def test_bad_words_token_ids_dedup_and_stop_at_vllms_bound() -> None:
    tokenizer = _CountingTokenizer()
    # vLLM's rule: the after-space spelling only with as many tokens and another first one (not " 5": "▁", "5")
    assert bad_words_token_ids(tokenizer, ["ab", " ab", "c", "5"], [[7]]) == [
        [7], [97, 98], [1097, 98], [99], [1099], [53]]
    tokenizer.calls = 0
    with pytest.raises(InvalidRequestError) as info:  # 2 sequences a word: the 65th word passes 128
        bad_words_token_ids(tokenizer, [f"w{i}" for i in range(100)])
    assert info.value.field == "bad_words" and tokenizer.calls == 130
    with pytest.raises(InvalidRequestError, match="1024 tokens"):
        bad_words_token_ids(tokenizer, ["x" * 600])
