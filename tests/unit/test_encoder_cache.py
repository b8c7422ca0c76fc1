"""The worker's encoder cache (across requests, pinned while a prefill needs it) and the data-parallel encoder."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
from model_utils import free_port, gloo_rank, spawn_ranks

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.mm.embeddings import EncoderOutputCache, ScheduledSpan, encode_items
from asyncllm.mm.encoder_cache import EncoderCache
from asyncllm.models.layers import TensorParallel
from asyncllm.protocol import MultiModalItem
from asyncllm.workers.mm_runner import MultiModalRunner, encoder_cache_bytes

ROW_BYTES = 4
"""One feature row of `_FakeEncoder` (hidden 1, float32)."""


class _FakeEncoder:
    """Embeddings = the token id; an image's row p = its pixel p (one row per pixel, hidden size 1)."""

    def __init__(self) -> None:
        self.encoded: list[int] = []
        """The first pixel of every image run through the encoder."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.float().unsqueeze(1)

    def embed_multimodal(self, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded += [int(p.flatten()[0]) for p in pixels]
        return pixels.flatten(1).unsqueeze(2)


def _image(first: int, offset: int, length: int = 2) -> MultiModalItem:
    """An image whose features are ``first, first + 1, ...`` (one row per placeholder); its hash is ``first``."""
    pixels = np.arange(first, first + length, dtype=np.float32)
    return MultiModalItem(f"h{first}", offset, length, pixels.tobytes(), [length], "float32")


def _embeds(cache: EncoderOutputCache, req_id: str, start: int, length: int) -> list[float]:
    return cache.inputs_embeds(torch.zeros(length), [ScheduledSpan(req_id, start, length, 0)]).flatten().tolist()


def test_pinned_entries_survive_the_budget_and_released_ones_go_oldest_first():
    cache = EncoderCache(budget_bytes=8)
    for name in "abc":
        cache.insert(name, torch.zeros(1))  # 4 bytes each, pinned: 12 > 8 is allowed
    assert (len(cache), cache.total_bytes) == (3, 12)
    cache.release("a")
    assert "a" not in cache and cache.total_bytes == 8  # over budget: the only unpinned entry goes
    cache.release("b")
    cache.release("c")
    assert ("b" in cache, "c" in cache) == (True, True)  # 8 bytes fit
    assert cache.acquire("b") is not None  # pinned again, so "c" is the only evictable one
    cache.insert("d", torch.zeros(1))
    cache.release("d")
    assert ("b" in cache, "c" in cache, "d" in cache) == (True, False, True)
    cache.release("b")
    cache.insert("e", torch.zeros(2))  # 8 bytes: everything unpinned makes room
    assert ("b" in cache, "d" in cache, cache.total_bytes) == (False, False, 8)


def test_a_second_request_with_the_same_image_elsewhere_skips_the_encoder():
    model = _FakeEncoder()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=100 * ROW_BYTES)
    cache.add_request("a", [_image(100, 1)])  # t I I
    assert _embeds(cache, "a", 0, 3) == [0.0, 100.0, 101.0]
    cache.remove_request("a")
    cache.add_request("b", [_image(100, 4)])  # t t t t I I: other text before the same image
    assert _embeds(cache, "b", 0, 6) == [0.0, 0.0, 0.0, 0.0, 100.0, 101.0]
    assert model.encoded == [100]
    assert (cache.num_queries, cache.num_hits, cache.num_encoded) == (2, 1, 1)


def test_without_a_budget_outputs_live_only_for_the_prefill():
    model = _FakeEncoder()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=0)
    for req_id in "ab":
        cache.add_request(req_id, [_image(100, 1)])
        _embeds(cache, req_id, 0, 3)
        cache.remove_request(req_id)
    assert model.encoded == [100, 100] and len(cache.store) == 0


def test_a_tiny_budget_evicts_between_requests_but_never_inside_a_prefill():
    model = _FakeEncoder()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=2 * ROW_BYTES)  # one image
    cache.add_request("a", [_image(100, 0)])
    cache.add_request("b", [_image(200, 0), _image(300, 2)])
    assert _embeds(cache, "a", 0, 1) == [100.0]  # "a" stops inside its image: pinned
    assert _embeds(cache, "b", 0, 4) == [200.0, 201.0, 300.0, 301.0]  # two more images, over the budget
    assert _embeds(cache, "a", 1, 1) == [101.0]  # still there: no second encoder run
    assert model.encoded == [100, 200, 300]
    assert ("h100" in cache.store, "h200" in cache.store, "h300" in cache.store) == (True, False, False)
    cache.remove_request("a")
    cache.add_request("c", [_image(200, 0)])  # evicted: encoded again, same features
    assert _embeds(cache, "c", 0, 2) == [200.0, 201.0]
    assert model.encoded == [100, 200, 300, 200]


def test_the_same_image_twice_in_one_step_is_encoded_once():
    model = _FakeEncoder()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=0)
    cache.add_request("a", [_image(100, 0), _image(100, 3)])  # I I t I I
    assert _embeds(cache, "a", 0, 5) == [100.0, 101.0, 0.0, 100.0, 101.0]
    assert model.encoded == [100] and (cache.num_queries, cache.num_hits) == (2, 1)
    cache.remove_request("a")
    assert len(cache.store) == 0  # both pins released


def test_a_preempted_request_releases_its_pins():
    cache = EncoderOutputCache(_FakeEncoder(), torch.device("cpu"), budget_bytes=0)
    cache.add_request("a", [_image(100, 0, length=4)])
    _embeds(cache, "a", 0, 2)
    assert "h100" in cache.store
    cache.remove_request("a")
    assert len(cache.store) == 0 and cache.items == {}


def test_the_pieces_of_one_output_encode_it_once_without_a_budget():
    """Qwen2.5-Omni's audio in video: chunks of one video's and one audio's outputs (`MultiModalItem.rows`) pin each
    output from its first chunk reached to its last passed, so prefill chunks of 1 token encode each once; a
    request removed midway releases them."""
    video, audio = _image(100, 0, length=5), _image(200, 0, length=3)  # V0 V1 A0 V2 V3 V4 A1 A2
    layout = [(video, 0, 2), (audio, 0, 1), (video, 2, 5), (audio, 1, 3)]
    pieces, offset = [], 0
    for whole, start, stop in layout:
        pieces.append(MultiModalItem(whole.mm_hash, offset, stop - start, whole.data, whole.shape, whole.dtype,
                                     rows=[start, whole.length]))
        offset += stop - start
    model = _FakeEncoder()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=0)
    cache.add_request("a", pieces)
    assert [_embeds(cache, "a", i, 1)[0] for i in range(8)] == [100, 101, 200, 102, 103, 104, 201, 202]
    assert sorted(model.encoded) == [100, 200] and len(cache.store) == 0  # passed: released
    cache.add_request("b", pieces)
    _embeds(cache, "b", 0, 3)
    assert len(cache.store) == 2
    cache.remove_request("b")
    assert len(cache.store) == 0


def test_an_item_whose_placeholders_disagree_with_its_data_fails_only_its_request():
    """A client's item of 3 rows of data laid over 2 placeholders: its request is reported failed and left
    unscattered, the other request of the step gets its rows, and the encoder's true output stays cached for a
    later item of the same image laid right."""
    model = _FakeEncoder()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=100 * ROW_BYTES)
    good, whole = _image(100, 0, length=2), _image(200, 0, length=3)
    cache.add_request("bad", [msgspec.structs.replace(whole, length=2)])  # I I
    cache.add_request("ok", [good])  # I I
    spans = [ScheduledSpan("bad", 0, 2, 0), ScheduledSpan("ok", 0, 2, 2)]
    assert cache.inputs_embeds(torch.tensor([7, 7, 0, 0]), spans).flatten().tolist() == [7.0, 7.0, 100.0, 101.0]
    assert cache.failed["bad"].startswith("mm_items[0]: its data encodes to 3 rows, not its 2 placeholders (")
    cache.remove_request("bad")
    cache.add_request("later", [whole])
    assert _embeds(cache, "later", 0, 3) == [200.0, 201.0, 202.0] and model.encoded == [200, 100]
    cache.add_request("hit", [msgspec.structs.replace(whole, length=1)])  # a cache hit is checked too
    _embeds(cache, "hit", 0, 1)
    assert list(cache.failed) == ["bad", "hit"]


def test_items_of_a_shape_the_encoder_refuses_fail_their_requests_and_the_others_run():
    class _Picky(_FakeEncoder):
        def embed_multimodal(self, pixels: torch.Tensor) -> torch.Tensor:
            if pixels.shape[1] == 5:
                raise RuntimeError("size mismatch")
            return super().embed_multimodal(pixels)

    cache = EncoderOutputCache(_Picky(), torch.device("cpu"), budget_bytes=0)
    cache.add_request("odd", [_image(300, 0, length=5)])
    cache.add_request("ok", [_image(100, 0)])
    spans = [ScheduledSpan("odd", 0, 5, 0), ScheduledSpan("ok", 0, 2, 5)]
    assert cache.inputs_embeds(torch.full((7,), 7), spans).flatten().tolist() == [7.0] * 5 + [100.0, 101.0]
    assert cache.failed == {"odd": "mm_items[0]: the encoder refused its data of shape [5] (the workers' log says why)"}


def test_a_batch_the_encoder_refuses_is_encoded_again_item_by_item():
    """Two images of one shape, one of values the encoder refuses (Mllama's aspect-ratio id out of range is such a
    case): only its request fails."""
    class _Picky(_FakeEncoder):
        def embed_multimodal(self, pixels: torch.Tensor) -> torch.Tensor:
            if bool((pixels == 666).any()):
                raise IndexError("index out of range in self")
            return super().embed_multimodal(pixels)

    model = _Picky()
    cache = EncoderOutputCache(model, torch.device("cpu"), budget_bytes=0)
    cache.add_request("bad", [_image(665, 0)])  # pixels 665, 666
    cache.add_request("ok", [_image(100, 0)])
    spans = [ScheduledSpan("bad", 0, 2, 0), ScheduledSpan("ok", 0, 2, 2)]
    assert cache.inputs_embeds(torch.full((4,), 7), spans).flatten().tolist() == [7.0, 7.0, 100.0, 101.0]
    assert list(cache.failed) == ["bad"] and model.encoded == [100]


def test_placeholders_that_disagree_with_an_m_rope_grid_fail_the_request_with_the_error():
    from asyncllm.workers.mm_runner import MRopePositions

    class _Grid:
        def mrope_positions(self, prompt_len, items):
            raise ValueError("an image of grid (1, 4, 4) has 3 placeholder tokens, not 4")

    positions = MRopePositions(_Grid())
    assert positions.add_request("a", 8, []) == "mm_items: an image of grid (1, 4, 4) has 3 placeholder tokens, not 4"
    assert positions.requests == {}  # its steps take the plain positions until the core ends it


def test_the_config_takes_data_mode_and_a_budget_and_refuses_a_negative_one():
    config = EngineConfig.create("m", mm_encoder_tp_mode="data", mm_encoder_cache_gb=0.25)
    assert (config.mm_encoder_tp_mode, encoder_cache_bytes(config)) == ("data", 2**28)
    with pytest.raises(ConfigError) as info:
        EngineConfig.create("m", mm_encoder_cache_gb=-1)
    assert info.value.field == "mm_encoder_cache_gb"


def test_data_mode_needs_a_model_that_opts_in():
    config = EngineConfig.create("m", mm_encoder_tp_mode="data")
    with pytest.raises(NotBuiltError, match="data-parallel encoding for _FakeEncoder") as info:
        MultiModalRunner(_FakeEncoder(), torch.device("cpu"), config, TensorParallel(0, 2))
    assert info.value.field == "mm_encoder_tp_mode"
    MultiModalRunner(_FakeEncoder(), torch.device("cpu"), config, TensorParallel(0, 1))  # alone: nothing to split


# ---- mm_encoder_tp_mode="data": the split and the gather, on two gloo ranks
IMAGES = [_image(10, 0, 4), _image(20, 4, 3), _image(30, 7, 6)]
"""Uneven feature lengths, so the ranks' shares differ in size."""


def _dp_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from asyncllm.workers.mm_encoder import DataParallelEncoder

    with gloo_rank(rank, world_size, port, timeout_s=60):
        model = _FakeEncoder()
        encoder = DataParallelEncoder(model, torch.device("cpu"), TensorParallel(rank, world_size))
        results = {n: encoder(IMAGES[:n], 1, torch.float32) for n in (1, 2, 3)}
        bf16 = encoder(IMAGES, 1, torch.bfloat16)  # any dtype crosses (gathered as bytes)
        laid_wrong = encoder([IMAGES[0], msgspec.structs.replace(IMAGES[1], length=1)], 1, torch.float32)
        refused = encoder([IMAGES[0], msgspec.structs.replace(IMAGES[1], shape=[2, 2])], 1, torch.float32)
        torch.save({"results": results, "bf16": bf16, "encoded": model.encoded, "laid_wrong": laid_wrong,
                    "refused": refused},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_data_parallel_encoding_splits_unevenly_and_gathers_everything(tmp_path):
    spawn_ranks(_dp_rank, (2, free_port(), str(tmp_path)))
    expected = encode_items(_FakeEncoder(), IMAGES, torch.device("cpu"))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for got in ranks:
        for n, features in got["results"].items():
            assert len(features) == n
            for rows, ref in zip(features, expected):
                assert torch.equal(rows, ref)
        assert all(torch.equal(rows, ref.bfloat16()) for rows, ref in zip(got["bf16"], expected))
        # an item laid over fewer placeholders than its data's rows: every rank gets the data's rows (the encoder
        # cache then fails its request alike on each), and no rank is left waiting in the gather
        assert [rows.shape[0] for rows in got["laid_wrong"]] == [4, 3]
        assert torch.equal(got["laid_wrong"][1], expected[1])
        # an item the encoder refuses on one rank (its 3 values cannot take shape [2, 2]) gathers as no rows on all
        assert [rows.shape[0] for rows in got["refused"]] == [4, 0]
    # round-robin shares: 1 image -> rank 0 alone; 2 -> one each; 3 -> two and one (then 3 again in bf16, then 2)
    assert ranks[0]["encoded"] == [10, 10, 10, 30, 10, 30, 10, 10]
    assert ranks[1]["encoded"] == [20, 20, 20, 20]


_RELEASE_ORDER = """
import numpy as np, torch
from asyncllm.mm.embeddings import EncoderOutputCache, ScheduledSpan
from asyncllm.protocol import MultiModalItem

class Encoder:
    def embed_input_ids(self, ids):
        return ids.float().unsqueeze(1)
    def embed_multimodal(self, pixels):
        return pixels.flatten(1).unsqueeze(2)

hashes = [f"h{i}" for i in range(6)]
data = np.arange(2, dtype=np.float32).tobytes()
pieces = [MultiModalItem(h, piece * len(hashes) + i, 1, data, [2], "float32", rows=[piece, 2])
          for piece in range(2) for i, h in enumerate(hashes)]
cache = EncoderOutputCache(Encoder(), torch.device("cpu"), budget_bytes=3 * 8)  # three outputs of 8 bytes
cache.add_request("a", pieces)
cache.inputs_embeds(torch.zeros(len(hashes)), [ScheduledSpan("a", 0, len(hashes), 0)])  # every first piece
cache.remove_request("a")  # releases the six outputs: the first three released are evicted
print(" ".join(h for h in hashes if h in cache.store))
"""


def test_a_removed_request_releases_its_pieces_in_the_order_reached_whatever_the_hash_seed(tmp_path):
    """Ranks are separate interpreters, each with its own string-hash seed: the order in which a request's pins are
    released decides which outputs a full cache evicts, so it must not follow a set's iteration order (every rank
    must hold the same entries). Pieces (`MultiModalItem.rows`) are pinned by their hash, a str."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", _RELEASE_ORDER], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                             env={**env, "PYTHONHASHSEED": str(seed)}) for seed in (1, 2, 3)]
    kept = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0]
    assert kept == ["h3 h4 h5"] * 3  # released in the order reached, so the first three reached are evicted
