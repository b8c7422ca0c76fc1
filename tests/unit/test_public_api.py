"""The public surface: one __all__, a cheap import that never touches torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import asyncllm
from asyncllm import errors


def test_all_names_resolve() -> None:
    for name in asyncllm.__all__:
        assert getattr(asyncllm, name) is not None, name
    assert asyncllm.AsyncEngine.__module__ == "asyncllm.engine.async_engine"


def test_import_is_cheap_and_cuda_free() -> None:
    code = "import sys, asyncllm; print(sorted(m for m in ('torch', 'transformers', 'zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_submodule_is_an_attribute_after_a_bare_import() -> None:
    """``import asyncllm`` then ``asyncllm.errors`` (as when the package imported its submodules eagerly): imported on
    first use, without torch; a name that is no submodule is still an AttributeError."""
    code = ("import sys, asyncllm\n"
            "print(hasattr(asyncllm, 'nosuch'), hasattr(asyncllm, 'engine.replica'),\n"
            "      sorted(m for m in sys.modules if m.startswith('asyncllm.')))\n"
            "mods = [asyncllm.errors, asyncllm.sampling, asyncllm.config, asyncllm.outputs]\n"
            "print([m.__name__ for m in mods], sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["False False []", "['asyncllm.errors', 'asyncllm.sampling', 'asyncllm.config', "
                                                     "'asyncllm.outputs'] []"]


def test_engine_class_import_leaves_torch_to_start() -> None:
    """`from asyncllm import AsyncEngine` at an app's module level does not import torch or the model classes:
    `start()` prepares the engine on a worker thread (transformers' tokenizer brings torch there, off the loop)."""
    code = ("import sys; from asyncllm import AsyncEngine\n"
            "print(sorted(m for m in ('torch', 'transformers', 'asyncllm.models.registry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_error_tree() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AsyncLLMError)
    assert issubclass(errors.NotBuiltError, errors.ConfigError)
    assert errors.InvalidRequestError("temperature", "bad").field == "temperature"


@pytest.mark.parametrize("prompt_tokens, max_tokens, field", [
    (7, None, None), (7, 1, None), (6, 2, None),  # room for one generated token; the sum may reach max_model_len
    (8, None, "prompt"), (7, 2, "max_tokens"), (8, 0, "prompt"),  # vLLM's order: the prompt alone first
])
def test_check_context_length_bounds(prompt_tokens: int, max_tokens: int | None, field: str | None) -> None:
    if field is None:
        errors.check_context_length(8, prompt_tokens, max_tokens)
        return
    with pytest.raises(errors.InvalidRequestError) as info:
        errors.check_context_length(8, prompt_tokens, max_tokens)
    assert (info.value.field, info.value.code) == (field, "context_length_exceeded")
    assert info.value.message == {
        "prompt": "This model's maximum context length is 8 tokens. However, your request has 8 input tokens. Please "
                  "reduce the length of the input messages.",
        "max_tokens": "'max_tokens' or 'max_completion_tokens' is too large: 2. This model's maximum context length "
                      "is 8 tokens and your request has 7 input tokens (2 > 8 - 7)."}[field]


def test_a_pooling_request_may_fill_the_context() -> None:
    """vLLM's pooling requests generate nothing: a prompt of max_model_len tokens fits, one more is refused in its
    words (the operation named), with the code; `field` names where the prompt was."""
    errors.check_context_length(8, 8, operation="embedding generation")
    with pytest.raises(errors.InvalidRequestError) as info:
        errors.check_context_length(8, 9, operation="classification", field="prompt.prompt_embeds")
    assert (info.value.field, info.value.code) == ("prompt.prompt_embeds", "context_length_exceeded")
    assert info.value.message == ("This model's maximum context length is 8 tokens. However, you requested 9 tokens "
                                  "in the input for classification. Please reduce the length of the input.")
