"""A chat refused by its size before its template renders it (asyncllm/engine/chat_bounds.py): the processor thread
every request shares renders templates, and 400,000 one-letter messages held it for seconds. And the template
variables a request may not set (asyncllm/tokenizer.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from asyncllm.bundled import bundled_model_path
from asyncllm.engine.chat_bounds import CUT_CHAT_MESSAGES
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling import SamplingParams
from asyncllm.tokenizer import check_template_kwargs


class RenderCounter:
    """The bundled tokenizer, counting its chat template renders."""

    def __init__(self) -> None:
        self.tokenizer, self.renders = AutoTokenizer.from_pretrained(bundled_model_path()), 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)


@pytest.fixture(scope="module")
def counted() -> tuple[RenderCounter, PromptTokenizer]:
    tokenizer = RenderCounter()
    prompts = PromptTokenizer(tokenizer, len(tokenizer))
    prompts.ready(64)
    return tokenizer, prompts


def _refusal(prompts: PromptTokenizer, messages: list, truncate: int | None = None) -> InvalidRequestError:
    job = SimpleNamespace(prompt=messages, params=SamplingParams(max_tokens=1, truncate_prompt_tokens=truncate),
                          options=RequestOptions(), chat=True)
    with pytest.raises(InvalidRequestError) as refused:
        prompts.token_ids(job)
    return refused.value


def test_more_messages_than_max_model_len_are_refused_unrendered(counted) -> None:
    """Each message renders one token at least (its role's marker): 65 of them cannot fit 64."""
    tokenizer, prompts = counted
    before = tokenizer.renders
    error = _refusal(prompts, [{"role": "user", "content": "a"}] * 65)
    assert error.field == "messages" and "maximum context length is 64 tokens" in str(error)
    assert "65 messages" in str(error) and tokenizer.renders == before


def test_a_cut_chat_keeps_its_last_tokens_of_more_messages_up_to_a_bound(counted) -> None:
    """With truncate_prompt_tokens the rendered chat's last tokens are kept (vLLM's): 65 messages fit 64 once cut;
    past CUT_CHAT_MESSAGES times max_model_len messages are refused unrendered still."""
    tokenizer, prompts = counted
    before = tokenizer.renders
    job = SimpleNamespace(prompt=[{"role": "user", "content": "a"}] * 65, options=RequestOptions(), chat=True,
                          params=SamplingParams(max_tokens=1, truncate_prompt_tokens=8))
    assert len(prompts.token_ids(job)) == 8 and tokenizer.renders == before + 1
    error = _refusal(prompts, [{"role": "user", "content": "a"}] * (CUT_CHAT_MESSAGES * 64 + 1), 8)
    assert error.field == "messages" and f"{CUT_CHAT_MESSAGES * 64 + 1} messages" in str(error)
    assert tokenizer.renders == before + 1


@pytest.mark.parametrize("content", ["hello " * 20_000, [{"type": "text", "text": "hello "}] * 20_000],
                         ids=["string", "parts"])
def test_message_texts_too_long_are_refused_by_their_parts_unrendered(counted, content) -> None:
    tokenizer, prompts = counted
    before = tokenizer.renders
    error = _refusal(prompts, [{"role": "user", "content": content}])
    assert error.field == "messages" and "characters, at least" in str(error) and tokenizer.renders == before


def test_a_chat_within_the_bounds_is_rendered_and_measured_as_before(counted) -> None:
    tokenizer, prompts = counted
    before = tokenizer.renders
    error = _refusal(prompts, [{"role": "user", "content": "hi"}] * 40)  # 40 messages, more than 64 tokens rendered
    assert "maximum context length is 64 tokens" in str(error) and tokenizer.renders == before + 1
    job = SimpleNamespace(prompt=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=1),
                          options=RequestOptions(), chat=True)
    assert prompts.token_ids(job) and tokenizer.renders == before + 2


@pytest.mark.parametrize("name", ["messages", "conversation", "tokenize", "chat_template"])
def test_a_template_kwarg_that_is_an_argument_of_the_renderer_is_refused_by_name(name) -> None:
    """``messages`` is the template's own variable: given again, Jinja's render raised a TypeError."""
    with pytest.raises(InvalidRequestError, match=r"are not template variables") as refused:
        check_template_kwargs({name: [{"role": "user", "content": "x"}], "enable_thinking": False})
    assert refused.value.field == "chat_template_kwargs" and name in str(refused.value)
    check_template_kwargs({"add_generation_prompt": False, "enable_thinking": False})  # variables: taken
