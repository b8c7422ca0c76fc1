"""Vision towers sharded over tensor-parallel ranks (mm_encoder_tp_mode="weights"): a tensor_parallel_size that does
not divide a tower's heads is refused by name before its shards are built (`clip.check_encoder_split`, which LLaVA's
and the Qwen-VL towers share: tests/unit/test_clip_tp.py, test_qwen_vision.py, test_qwen3_vision.py); "data" keeps
the tower whole and takes any size. The towers' configs are their tests' tiny ones (tests/*_utils.py). No process
group is needed: building the shards runs no collectives."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.selector import get_attention_backend
from asyncllm.errors import ConfigError
from asyncllm.models.ernie4_5_vl_vision import ErnieVisionTower
from asyncllm.models.hunyuan_vl import HunYuanVLForConditionalGeneration, HunYuanVLVisionTower
from asyncllm.models.layers import TensorParallel
from asyncllm.models.paddleocr_vl import PaddleOCRVisionModel


def _hunyuan_vl_config():
    """tests/hunyuan_vl_utils.py's tiny config: a tower of 2 heads of width 16, MLP 64; a decoder of 4 heads."""
    from transformers import HunYuanVLConfig

    rope = {"type": "xdrope", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10_000.0, "xdrope_section": [2, 2, 2, 2]}
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
                pad_token_id=2, rope_scaling=rope)
    vision = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, patch_size=8,
                  max_image_size=64, spatial_merge_size=2)
    return HunYuanVLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, im_start_id=120,
                           image_token_id=121, im_end_id=122, im_newline_id=123,
                           architectures=["HunYuanVLForConditionalGeneration"])


def _paddleocr_vl_vision():
    from transformers import PaddleOCRVisionConfig

    return PaddleOCRVisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                 image_size=56, rope_parameters={"rope_type": "axial", "rope_theta": 10_000.0})


def _ernie_vl_vision():
    from transformers import Ernie4_5_VLMoeVisionConfig

    return Ernie4_5_VLMoeVisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64)


TOWERS = {  # tower class, its vision config, the config field of its heads
    "HunYuan VL": (HunYuanVLVisionTower, lambda: _hunyuan_vl_config().vision_config, "num_attention_heads"),
    "PaddleOCR-VL": (PaddleOCRVisionModel, _paddleocr_vl_vision, "num_attention_heads"),
    "ERNIE-4.5-VL": (ErnieVisionTower, _ernie_vl_vision, "num_heads"),
}


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_a_size_not_dividing_the_vision_heads_is_refused_by_name_and_a_dividing_one_builds(family):
    tower_cls, vision_config, heads = TOWERS[family]
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size=4 .*vision_config\.{heads}=2 ") as info:
        tower_cls(vision_config(), TensorParallel(0, 4), torch.float32)
    assert info.value.field == "tensor_parallel_size" and info.value.value == 4
    assert "intermediate_size" not in str(info.value)  # 64 splits over 4: only the heads are named
    assert "mm_encoder_tp_mode='data'" in str(info.value)  # what to do instead
    tower_cls(vision_config(), TensorParallel(1, 2), torch.float32)


def _hunyuan_vl(tp: TensorParallel, mode: str) -> HunYuanVLForConditionalGeneration:
    backend = get_attention_backend(None, torch.device("cpu"), torch.float32)
    return HunYuanVLForConditionalGeneration(_hunyuan_vl_config(), dtype=torch.float32, tp=tp, attn_backend=backend,
                                             max_position=128, mm_encoder_tp_mode=mode)


def test_hunyuan_vl_refuses_the_size_in_weights_mode_and_keeps_the_tower_whole_in_data_mode():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 .*vision_config\.num_attention_heads=2 "):
        _hunyuan_vl(TensorParallel(0, 4), "weights")
    q_proj = _hunyuan_vl(TensorParallel(3, 4), "data").visual.encoder.layers[0].self_attn.q_proj
    assert q_proj.weight.shape == (32, 32)  # both heads on every rank
    q_proj = _hunyuan_vl(TensorParallel(1, 2), "weights").visual.encoder.layers[0].self_attn.q_proj
    assert q_proj.weight.shape == (16, 32)  # one head of width 16 a rank
