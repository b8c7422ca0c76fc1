"""Mllama's pieces without an engine: which tokens see which images (transformers' processor's rule), the prefix
item that keys the blocks before the first image by every image, the KV-cache layers, the refusals, the memory an
image's cross-attention states take and the KV budget keeps for them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncllm.attention.selector import get_attention_backend
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kv.hashing import extend_block_hashes
from asyncllm.models.layers import TensorParallel
from asyncllm.models.mllama import MllamaForConditionalGeneration, image_spans, image_state_bytes
from asyncllm.models.vision_language import image_limit
from asyncllm.protocol import MultiModalItem
from asyncllm.workers.mm_runner import request_states_reserve

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


def test_a_tensor_parallel_size_that_splits_a_kv_head_is_refused_by_name():
    """The tiny decoder's 2 KV heads split over 2 ranks (the engine test) but not over 4 (a cross-attention KV head
    is not replicated)."""
    from mllama_utils import tiny_mllama_config

    backend = get_attention_backend(None, torch.device("cpu"), torch.float32)
    with pytest.raises(NotBuiltError, match="tensor_parallel_size=4 .*Mllama's 2 cross-attention KV heads over 4 ranks"):
        MllamaForConditionalGeneration(tiny_mllama_config(), dtype=torch.float32, tp=TensorParallel(0, 4),
                                       attn_backend=backend, max_position=64)


def _config_11b() -> SimpleNamespace:
    vision = SimpleNamespace(max_num_tiles=4, image_size=560, patch_size=14)
    text = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38])
    return SimpleNamespace(vision_config=vision, text_config=text)


def test_an_images_cross_attention_states_take_210_mb_on_11b():
    """8 layers x K and V x 4 tiles of 1601 rows x 8 KV heads of 128 x 2 bytes; half of it per rank at TP=2."""
    assert image_state_bytes(_config_11b(), 1, torch.bfloat16) == 8 * 2 * 6404 * 8 * 128 * 2 == 209_846_272
    assert image_state_bytes(_config_11b(), 2, torch.bfloat16) == 209_846_272 // 2


class _Model:
    mm_default_image_limit = MllamaForConditionalGeneration.mm_default_image_limit
    image_state_bytes = 2**20


def _config(max_num_seqs: int, limits: dict[str, int] | None) -> SimpleNamespace:
    return SimpleNamespace(max_num_seqs=max_num_seqs, multimodal_config=SimpleNamespace(limit_mm_per_prompt=limits))


def test_the_kv_budget_keeps_every_seats_images_cross_attention_states():
    """Every seat of max_num_seqs may hold limit_mm_per_prompt's images (one when unset): their states are kept out
    of the KV cache's budget; over half of it is refused, naming max_num_seqs and how many seats fit."""
    assert image_limit(MllamaForConditionalGeneration, None) == 1
    assert image_limit(MllamaForConditionalGeneration, {"image": 3}) == 3
    assert request_states_reserve(_Model(), _config(8, None), 2**30) == 8 * 2**20
    assert request_states_reserve(_Model(), _config(8, {"image": 3}), 2**30) == 24 * 2**20
    assert request_states_reserve(object(), _config(8, None), 2**30) == 0  # a model without such states
    with pytest.raises(ConfigError, match="max_num_seqs.*at most 170 .* 3 MB"):
        request_states_reserve(_Model(), _config(256, {"image": 3}), 2**30)
