"""A both-ways span that reaches past its item's rows (PaliGemma's whole prompt, on an item of no rows): the core
takes it only inside the prompt, and the prefix cache keys each of its blocks by every token and item in it."""

from __future__ import annotations

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.kv.hashing import extend_block_hashes
from asyncllm.mm.cache import ProcessorCacheStore, fill_mm_items
from asyncllm.protocol import AddRequest, MultiModalItem
from asyncllm.sampling import SamplingParams


def _span(stop: int) -> MultiModalItem:
    return MultiModalItem("prefix", 0, 0, b"", [0], bidirectional=[0, stop])


def _image(mm_hash: str = "img", span: list[int] | None = None) -> MultiModalItem:
    return MultiModalItem(mm_hash, 0, 4, b"\0" * 8, [2], bidirectional=span or [])


def _hashes(tokens: list[int], items: list[MultiModalItem], first: int = 0) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, 4, first, None, items)
    extend_block_hashes(out, tokens, 4, 4, None, items)  # incremental: the later blocks alone
    return out


def test_a_span_past_its_rows_keys_every_block_by_all_of_it():
    prompt, other_text = [9, 9, 9, 9, 5, 6, 7, 8, 1, 2, 3], [9, 9, 9, 9, 5, 6, 7, 8, 1, 2, 4]
    tokens, decoded = prompt + [10], other_text + [10]
    items = [_span(11), _image()]
    same = _hashes(tokens, items)
    assert _hashes(tokens, items, first=2) == same  # hashing in two calls changes nothing
    changed = _hashes(decoded, [_span(11), _image()])
    assert changed[0] != same[0] and changed[1] != same[1]  # the image block's KV saw the last prompt token
    assert _hashes(tokens, [_span(11), _image("other")])[0] != same[0]
    plain = _hashes(tokens, [_image()])
    assert plain[0] != same[0]  # without the span: a Gemma 3 style image block, keyed by the image alone
    assert _hashes(decoded, [_image()])[:2] == plain[:2]
    assert _hashes(tokens, [_image(span=[0, 4])]) == plain  # a span within its rows needs no key of its own


@pytest.mark.parametrize("span, ok", [([0, 8], True), ([0, 9], False), ([-1, 4], False), ([3, 3], False)])
def test_the_core_takes_an_item_of_no_rows_only_with_a_span_inside_the_prompt(span, ok):
    item = MultiModalItem("prefix", 0, 0, b"", [0], bidirectional=span)
    message = AddRequest("r", [5] * 8, SamplingParams(), [1], 0.0, mm_items=[item, _image()])
    if ok:
        fill_mm_items(ProcessorCacheStore(100), message)
    else:
        with pytest.raises(InvalidRequestError, match="bidirectional"):
            fill_mm_items(ProcessorCacheStore(100), message)
    with pytest.raises(InvalidRequestError, match="placeholders"):  # no rows and no span: no item at all
        fill_mm_items(ProcessorCacheStore(100), AddRequest("r", [5] * 8, SamplingParams(), [1], 0.0,
                                                           mm_items=[MultiModalItem("x", 0, 0, b"", [0])]))


def test_paligemma_prompt_text_is_its_processors():
    """``PaliGemmaProcessor``'s layout: the images' ``<image>`` first, ``<bos>`` after the last (first without
    images), a closing newline."""
    from types import SimpleNamespace

    from asyncllm.models.paligemma import PaliGemmaForConditionalGeneration as PaliGemma

    tokenizer = SimpleNamespace(bos_token="<bos>")
    assert PaliGemma.mm_prompt_text(tokenizer, "caption en", 0) == "<bos>caption en\n"
    assert PaliGemma.mm_prompt_text(tokenizer, "caption en", 2) == "<image><image><bos>caption en\n"
    assert PaliGemma.mm_prompt_text(tokenizer, "<image>answer", 1) == "<image><bos>answer\n"


def test_each_blocks_keys_are_those_of_the_items_overlapping_it_found_without_a_scan():
    """The block keys (found by bisecting the items' offsets and ends) are a scan's, for items of every size, of no
    rows, touching one another, and a long span, over blocks of one and of several items."""
    import random

    from asyncllm.kv.hashing import _ItemIndex, _mm_keys, _Span

    rng = random.Random(0)
    items, offset = [], 1
    while offset < 200:
        length = rng.choice([0, 1, 3, 4, 9, 17])
        items.append(MultiModalItem(f"h{len(items)}", offset, length, b"", [1], rows=[0, 20] if length == 3 else []))
        offset += length + rng.choice([0, 0, 1, 5])
    spans = [_Span("span:x", 6, 30)]
    index = _ItemIndex(items, spans)
    for size in (1, 4, 16):
        for start in range(0, 220, size):
            assert index.keys(start, start + size) == _mm_keys([*items, *spans], start, start + size), (size, start)


def test_an_item_laid_over_another_number_of_placeholders_shares_no_block():
    """The same image at the same place over 8 placeholders and over 7 (a host's bug, which the workers fail): no
    block of the second may serve the first."""
    tokens = [5, 6] + [9] * 8 + [7, 7]
    right, short = MultiModalItem("img", 2, 8, b"", [1]), MultiModalItem("img", 2, 7, b"", [1])
    assert _hashes(tokens, [right])[0] != _hashes(tokens, [short])[0]
