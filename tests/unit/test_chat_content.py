"""vLLM's chat template content format (asyncllm/chat_content.py): detection and the two content shapes, rendered
as vLLM renders its parsed conversation (transformers' ``apply_chat_template`` over the same messages)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from asyncllm.bundled import bundled_model_path
from asyncllm.chat_content import detect_content_format, formatted_messages
from asyncllm.errors import InvalidRequestError
from asyncllm.tiny import CHAT_TEMPLATE
from asyncllm.tokenizer import apply_chat_template

GEMMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}S:{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}"
)
"""Gemma 3's shape: a loop over a message's content parts (a string content marked, to see it wrapped)."""
LLAMA4_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{% set messages = messages[1:] %}{% endif %}"
    "{% set loop_messages = messages %}{% set turns = loop_messages %}"
    "{% for message in turns %}<|header|>{{ message.role }}<|end|>"
    "{% for content in message.content | sort(attribute='type') %}{{ content['text'] }}{% endfor %}{% endfor %}"
)
"""Llama 4's shape: messages sliced and aliased (twice) first, content read by attribute through a filter."""
CONDITIONAL_ALIAS = LLAMA4_LIKE.replace("{% set loop_messages = messages %}",
                                        "{% set loop_messages = messages if messages else [] %}")
"""An alias through a conditional expression: vLLM's detection does not follow it ("string")."""
CONTENT_ALIASED = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if content is string %}{{ content }}{% else %}{% for part in content %}{{ part.text }}{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""The content aliased to a variable first (vLLM matches ``for x in content``)."""
STRING_ONLY = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim }}\n{% endfor %}"
JOINING = "{% for m in messages %}{{ m['content'] | map(attribute='text') | join('|') }}{% endfor %}"
"""Reads parts without a loop: vLLM detects no loop, so "string"."""
TUPLE_TARGET = "{% for i, m in messages | list | batch(1) %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}"
"""A tuple loop target over messages: vLLM's detection gives up ("string")."""

TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_model_path())


@pytest.mark.parametrize("template, expected", [
    (CHAT_TEMPLATE, "string"), (STRING_ONLY, "string"), (JOINING, "string"), (TUPLE_TARGET, "string"),
    (CONDITIONAL_ALIAS, "string"),
    ("{% for m in messages %}{{ m.content", "string"),  # does not parse
    (GEMMA3_LIKE, "openai"), (LLAMA4_LIKE, "openai"), (CONTENT_ALIASED, "openai"),
], ids=["tiny", "string-only", "joining", "tuple-target", "conditional-alias", "unparsable", "gemma3", "llama4",
        "content-aliased"])
def test_auto_detects_a_loop_over_message_content(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_string_joins_text_parts_with_newlines_and_openai_keeps_them() -> None:
    messages = [*TWO_PARTS, {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert [m["content"] for m in formatted_messages(messages, "string")] == ["first\nsecond", "", "a\nb"]
    openai = [m["content"] for m in formatted_messages([*messages, {"role": "user", "content": "hi"}], "openai")]
    assert openai == [TWO_PARTS[0]["content"], [], "a\nb", [{"type": "text", "text": "hi"}]]  # tool: joined, as vLLM
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    assert formatted_messages(image, "openai")[0]["content"] == image[0]["content"]
    with pytest.raises(InvalidRequestError, match="need a multimodal model"):
        formatted_messages(image, "string")


def test_string_writes_each_mediums_missing_placeholder_ahead_of_the_text_as_vllm() -> None:
    """One placeholder per medium the text does not hold, by kind in the order of their first parts, then the text
    (vLLM's ``_get_full_multimodal_text_prompt``); more placeholders in the text than media is refused."""
    marks = {"image": "<I>", "audio": "<A>"}.__getitem__
    parts = [{"type": "audio", "audio": ""}, {"type": "text", "text": "x <I> y"}, {"type": "image"}, {"type": "image"},
             {"type": "text", "text": "z"}, {"type": "audio", "audio": ""}]
    content = formatted_messages([{"role": "user", "content": parts}], "string", marks)[0]["content"]
    assert content == "<A>\n<A>\n<I>\nx <I> y\nz"
    assert formatted_messages([{"role": "user", "content": [{"type": "image"}]}], "string", marks)[0]["content"] \
        == "<I>"  # media alone: the placeholders alone (vLLM since its separator option; "<I>\n" before)
    assert formatted_messages([{"role": "user", "content": [{"type": "image"}, {"type": "audio", "audio": ""},
                                                            {"type": "text", "text": ""}]}], "string", marks)[0][
        "content"] == "<I>\n<A>"
    with pytest.raises(InvalidRequestError, match="item 0: its text holds 2 '<I>' placeholders but the message has 1"):
        formatted_messages([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<I><I>"}]}],
                           "string", marks)


def test_models_whose_vllm_placeholder_is_not_their_marker_refuse_string_media() -> None:
    """Qwen2-Audio, the Omni thinkers, Ernie-VL, PaliGemma, InternVL, Command A Vision: vLLM writes other text than
    the marker there (numbered, or other tokens), so a "string" chat's media parts are refused naming the field."""
    from types import SimpleNamespace

    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.qwen2_audio import Qwen2AudioForConditionalGeneration

    fake = SimpleNamespace(_markers=lambda: {"audio": 7}, _model_cls=Qwen2AudioForConditionalGeneration)
    with pytest.raises(InvalidRequestError, match="'string' with audio parts is not built") as info:
        MultiModalProcessor.placeholder_text(fake, "audio")
    assert info.value.field == "chat_template_content_format"


def test_rendered_prompts_match_vllms_conversation(tokenizer) -> None:
    """The ids are transformers' over the conversation vLLM builds: one "\\n"-joined string with the tiny model's
    string template; the parts themselves (a string content as one text part) with a template that loops."""
    joined = tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}], add_generation_prompt=True,
                                           return_dict=False)
    assert apply_chat_template(tokenizer, TWO_PARTS) == joined
    vllm_openai = [{"role": "system", "content": [{"type": "text", "text": " sys "}]}, *TWO_PARTS]
    ours = [{"role": "system", "content": " sys "}, *TWO_PARTS]
    expected = tokenizer.apply_chat_template(vllm_openai, chat_template=GEMMA3_LIKE, add_generation_prompt=True,
                                             return_dict=False)
    assert apply_chat_template(tokenizer, ours, chat_template=GEMMA3_LIKE) == expected
    forced = apply_chat_template(tokenizer, ours, chat_template=GEMMA3_LIKE, content_format="string")
    assert tokenizer.decode(forced).count("first\nsecond") == 1 and forced != expected
    with pytest.raises(InvalidRequestError, match="chat_template_content_format"):
        apply_chat_template(tokenizer, ours, content_format="strings")
    empty = apply_chat_template(tokenizer, [{"role": "user", "content": ""}])  # no content is none, as vLLM
    assert apply_chat_template(tokenizer, [{"role": "user"}]) == empty
    assert apply_chat_template(tokenizer, [{"role": "user", "content": None}]) == empty


def test_engine_chat_reads_text_like_parts_as_vllms_llm_chat(tokenizer) -> None:
    """`AsyncEngine.chat` (as vLLM's ``LLM.chat``) takes bare string parts and ``input_text`` / ``output_text`` /
    ``refusal`` / ``thinking`` parts as text parts, a text part of text None skipped: a text chat (not media), with
    the "\n"-joined string or the parts vLLM gives the template."""
    from asyncllm.mm.host import multimodal_prompt

    user = ["first", {"type": "input_text", "text": "second"}, {"type": "text", "text": None}]
    reply = [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "b"}, {"type": "thinking", "thinking": "c"}]
    given = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    plain = [TWO_PARTS[0], {"role": "assistant", "content": [{"type": "text", "text": t} for t in "abc"]}]
    assert multimodal_prompt(None, given, True) is None  # a text chat: no "takes no images"
    for template in (CHAT_TEMPLATE, GEMMA3_LIKE):
        assert apply_chat_template(tokenizer, given, chat_template=template) == \
            apply_chat_template(tokenizer, plain, chat_template=template)
    assert formatted_messages(given, "string")[1]["content"] == "a\nb\nc"
    with pytest.raises(InvalidRequestError, match="a content part must be a string or a dict"):
        formatted_messages([{"role": "user", "content": [5]}], "string")


def test_multimodal_chat_renders_vllms_openai_conversation(tokenizer) -> None:
    """The multimodal path (asyncllm/mm/host.py): media parts in place, a string content as one text part (an
    ``input_text`` part as a text part too); a list of text parts alone is a text chat, and a text model refuses
    media parts."""
    from types import SimpleNamespace

    from asyncllm.mm.host import multimodal_prompt

    fake = SimpleNamespace(tokenizer=tokenizer, process=lambda token_ids, inputs, field, overrides: token_ids,
                           placeholder_text=lambda kind: "<image>")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": [image, {"type": "input_text", "text": "what?"}]}]
    vllm_openai = [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
                   {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    expected = tokenizer.apply_chat_template(vllm_openai, chat_template=GEMMA3_LIKE, add_generation_prompt=True,
                                             return_dict=False)
    assert multimodal_prompt(fake, messages, True, chat_template=GEMMA3_LIKE) == expected
    assert multimodal_prompt(None, TWO_PARTS, True) is None
    with pytest.raises(InvalidRequestError, match="takes no images"):
        multimodal_prompt(None, messages, True)


def test_responses_api_input_text_parts_stay_parts() -> None:
    """The Responses API's ``input_text`` parts reach the engine as text parts (joined with "\\n" there, as vLLM)."""
    from asyncllm.integrations.responses_api import input_messages

    parts = [{"type": "input_text", "text": "first"}, {"type": "input_text", "text": "second"}]
    messages = input_messages([{"type": "message", "role": "user", "content": parts}], None)
    assert formatted_messages(messages, "string") == [{"role": "user", "content": "first\nsecond"}]
