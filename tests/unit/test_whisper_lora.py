"""LoRA on Whisper's decoder in process (asyncllm/models/whisper.py, whisper_lora.py): adapters on the self-attention's
q / k / v / out, the cross-attention's (its keys and values computed once per request from the encoder's rows, each
request's with its own adapter) and ``fc1`` / ``fc2``: every position's logits equal PEFT's on transformers'
``WhisperForConditionalGeneration`` (fp32, 1e-4), for a request with the adapter batched with one without it; the
host checks the adapter against the decoder's shapes and refuses one with encoder matrices."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lora_utils import make_adapter
from model_utils import MaskedRun
from safetensors.torch import load_file, save_file
from whisper_utils import make_tiny_whisper

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.lora import read_adapter
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.lora import LoRAContext, attach_lora_layers, load_adapter_tensors
from asyncllm.models.registry import kv_cache_spec

TARGETS = r"model\.decoder\.layers\.\d+\.((self_attn|encoder_attn)\.(q|k|v|out)_proj|fc1|fc2)"
"""vLLM's Whisper LoRA targets: the decoder's self- and cross-attention projections and its MLP."""
SLOTS, SLOT, ATOL = 2, 1, 1e-4


class _Starting:
    """The model, handed the starting requests' encoder rows in its first step as the multimodal runner hands them
    (`AttentionMetadata.encoder_outputs`, by worker row)."""

    def __init__(self, model: Any, encoded: list[torch.Tensor]) -> None:
        self.model, self.encoded = model, encoded

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: Any) -> torch.Tensor:
        if self.encoded:
            metadata.encoder_outputs = list(zip(metadata.request_rows_cpu, self.encoded, strict=True))
            self.encoded = []
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def _ours(path: str, adapter: str, features: torch.Tensor, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Both requests over a paged run in chunks and one-token steps, the first with the adapter in `SLOT`."""
    model = load_model(EngineConfig.create(path, max_model_len=64), load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    context = LoRAContext()
    layers = attach_lora_layers(model, SLOTS, 8, context)
    for module_name, part, lora_a, lora_b, scaling in load_adapter_tensors(read_adapter(adapter), model):
        layers[module_name].set(SLOT, part, lora_a, lora_b, scaling)
    with torch.no_grad():
        encoded = model.embed_multimodal(features[:, None])
    run = MaskedRun(_Starting(model, encoded), sequences, block_size=4)
    run.context, run.slots, run.num_slots = context, [SLOT, -1], SLOTS
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    return run.run([[9, 7], [6, 1], [1, 1], [1, 9], [6, 1]])


def _hf(path: str, adapter: str, features: torch.Tensor, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits of each (audio, tokens): the base model's, then PEFT's with the adapter."""
    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = [dict(input_features=f[None], decoder_input_ids=torch.tensor([t])) for f, t in zip(features, sequences)]
    with torch.no_grad():
        base = [model(**each).logits[0] for each in inputs]
        peft = PeftModel.from_pretrained(model, adapter).eval()
        return base + [peft(**each).logits[0] for each in inputs]


def test_decoder_adapters_equal_peft_with_the_base_model_in_the_same_batch(tmp_path) -> None:
    from transformers import WhisperForConditionalGeneration

    path = make_tiny_whisper(tmp_path / "whisper")
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=5, rank=4, alpha=8, targets=TARGETS,
                           auto_class=WhisperForConditionalGeneration)
    assert len(read_adapter(adapter).modules) == 2 * 10  # every target of both layers
    checker = prepare(EngineConfig.create(path, enable_lora=True, max_lora_rank=8)).lora
    assert checker is not None and checker.check(LoRARequest("w", 1, adapter))
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 16, 200, generator=gen)
    vocab = load_hf_config(path).vocab_size
    sequences = [torch.randint(6, vocab, (n,), generator=gen).tolist() for n in (23, 19)]
    with_adapter, base = _ours(path, adapter, features, sequences)
    hf_base, hf_base_second, expected, _ = _hf(path, adapter, features, sequences)
    assert (expected - hf_base).abs().max() > 0.5  # the adapter changes the logits
    torch.testing.assert_close(with_adapter, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(base, hf_base_second, atol=ATOL, rtol=0)
    tensors = load_file(f"{adapter}/adapter_model.safetensors")  # plus an encoder layer's matrices: refused
    tensors["base_model.model.model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.encoder.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "adapter_config.json").write_text((tmp_path / "adapter" / "adapter_config.json").read_text())
    save_file(tensors, str(encoder / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="adapters on the audio tower"):
        checker.check(LoRARequest("e", 2, str(encoder)))
