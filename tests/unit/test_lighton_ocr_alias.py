"""LightOnOCR under vLLM's spelling of its architecture (``LightOnOCRForConditionalGeneration``, which vLLM registers
and the released checkpoints' first config.json wrote, with ``model_type`` "mistral3"; transformers 5 says
``LightOnOcrForConditionalGeneration``): through config.json or ``hf_overrides`` it loads the same model, and the
config is rewritten to our name so that every later lookup sees one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lighton_ocr_utils import make_tiny_lighton_ocr

from asyncllm.config import EngineConfig
from asyncllm.models.architectures import architecture_of
from asyncllm.models.checkpoint import served_hf_config
from asyncllm.models.lighton_ocr import LightOnOcrForConditionalGeneration
from asyncllm.models.loader import load_model
from asyncllm.models.registry import get_model_class

VLLM_NAME, OURS = "LightOnOCRForConditionalGeneration", "LightOnOcrForConditionalGeneration"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_lighton_ocr(tmp_path_factory.mktemp("lighton_ocr"))


@pytest.fixture(scope="module")
def vllm_era(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same checkpoint, its config.json as vLLM-era tooling wrote it: vLLM's name, Mistral 3's model type."""
    path = tmp_path_factory.mktemp("vllm_era") / "ckpt"
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=[VLLM_NAME], model_type="mistral3")
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _features(path: str, overrides: dict | None = None) -> torch.Tensor:
    hf_config = served_hf_config(path, overrides)
    model = load_model(EngineConfig.create(path, max_model_len=64), hf_config, torch.device("cpu"), torch.float32)
    assert isinstance(model, LightOnOcrForConditionalGeneration) and hf_config.architectures == [OURS]
    pixels = torch.randn(2, 3, 70, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.embed_multimodal(pixels)


@pytest.mark.parametrize("how", ["config.json", "hf_overrides"])
def test_vllms_spelling_loads_the_same_model(tiny, vllm_era, how):
    path, overrides = (vllm_era, None) if how == "config.json" else (tiny, {"architectures": [VLLM_NAME]})
    hf_config = served_hf_config(path, overrides)
    assert hf_config.architectures == [VLLM_NAME]  # as read, before the host's check
    assert architecture_of(hf_config) == OURS and hf_config.architectures == [OURS]
    assert get_model_class(hf_config) is LightOnOcrForConditionalGeneration
    expected = _features(tiny)
    assert expected.shape == (2, 2 * 4, 64)  # 5 x 8 patches: 2 x 4 merged, the odd row dropped
    assert torch.equal(_features(path, overrides), expected)
