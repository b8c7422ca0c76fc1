"""Mllama's pieces without an engine: which tokens see which images (transformers' processor's rule), the prefix
item that keys the blocks before the first image by every image, the KV-cache layers, the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncllm.errors import NotBuiltError
from asyncllm.kv.hashing import extend_block_hashes
from asyncllm.models.layers import TensorParallel
from asyncllm.models.mllama import MllamaForConditionalGeneration, image_spans
from asyncllm.protocol import MultiModalItem

IMAGE = 9


@pytest.mark.parametrize("tokens", [
    [1, IMAGE, 2, 3],                              # one image
    [1, 2, IMAGE, 3, IMAGE, 4, 5],                 # two apart: the first until the second
    [IMAGE, IMAGE, 2, 3, IMAGE, 4],                # a run of two, then one
    [1, IMAGE, 2, IMAGE, IMAGE, 3],                # one, then a run of two at the end
    [IMAGE, 1, IMAGE, IMAGE, IMAGE],               # the prompt ends in a run
])
def test_image_spans_follow_the_processor(tokens):
    """Each image's [start, end) equals transformers' ``get_cross_attention_token_mask``; an end at the prompt's
    length (the spans generated tokens see too) is None."""
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    expected = [(start, None if end in (-1, len(tokens)) else end)
                for start, end in get_cross_attention_token_mask(tokens, IMAGE)]
    offsets = [i for i, token in enumerate(tokens) if token == IMAGE]
    assert image_spans(offsets, len(tokens)) == expected


def _image(mm_hash: str, offset: int) -> MultiModalItem:
    return MultiModalItem(mm_hash, offset, 1, b"\0" * 4, [1])


def test_the_tokens_before_the_first_image_are_keyed_by_every_image():
    """A prompt with text before its first image gets a first item over that text whose key names all its images:
    the first blocks' hashes differ when any image differs, though the images sit in later blocks; a prompt that
    starts with its image needs none."""
    tokens = list(range(12))

    def hashes(images: list[MultiModalItem]) -> list[bytes]:
        items = MllamaForConditionalGeneration.mm_prompt_items(None, tokens, images)
        out: list[bytes] = []
        extend_block_hashes(out, tokens, 4, 3, None, items)
        return out

    same = hashes([_image("a", 8), _image("b", 10)])
    other = hashes([_image("a", 8), _image("c", 10)])
    assert same == hashes([_image("a", 8), _image("b", 10)])
    assert same[0] != other[0] and same[1] != other[1]
    items = MllamaForConditionalGeneration.mm_prompt_items(None, tokens, [_image("a", 8)])
    assert (items[0].offset, items[0].length) == (0, 8) and not MllamaForConditionalGeneration.mm_cross_item(items[0])
    assert MllamaForConditionalGeneration.mm_prompt_items(None, tokens, [_image("a", 0)]) == [_image("a", 0)]


def test_cross_attention_layers_take_no_kv_cache_layer():
    text = SimpleNamespace(num_hidden_layers=40, cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38])
    assert MllamaForConditionalGeneration.kv_cache_layers(text) == 32


def test_tensor_parallel_is_refused_by_name():
    with pytest.raises(NotBuiltError, match="tensor_parallel_size"):
        MllamaForConditionalGeneration(SimpleNamespace(), dtype=torch.float32, tp=TensorParallel(0, 2),
                                       attn_backend=None, max_position=64)  # type: ignore[arg-type]
