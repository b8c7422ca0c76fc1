"""The decode forward `capture_decode_graphs` captures (DecodeBuffers.load_warmup's layout: every slot -1) on the
triton backend reads no tensor's value on the host: such a read (``.item()``, ``bool(t)``, boolean-mask indexing)
fails under CUDA stream capture ("operation not permitted when stream is capturing"), so the engine would not
start with graphs on, and eagerly it stalls every layer on the GPU. Run on the CPU under Triton's interpreter,
with a dispatch mode that records every op needing a value on the host.

ALiBi (BLOOM, MPT) and latent attention's one-part cache (DeepSeek-V2, with its grouped expert routing) write the
KV cache with `asyncllm.kernels.kv_write` (torch's reference write selected the valid slots on the host); Qwen3
(the fused rotary + KV write) is the control."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.workers.cuda_graphs import DecodeBuffers
from asyncllm.workers.step_staging import StepStaging

HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2"}
"""Ops whose result depends on a tensor's values on the host (``bool(t)`` and ``t.item()`` reach
``_local_scalar_dense``); boolean-mask indexing is caught by its index's dtype (`HostReads`)."""

_TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_TINY, num_key_value_heads=2, head_dim=16)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=128, hidden_size=64, n_layer=1, n_head=4)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(vocab_size=128, d_model=64, n_layers=1, n_heads=4)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(  # a dense layer, then a MoE one
        _TINY, num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, topk_method="group_limited_greedy")),
}


class HostReads(TorchDispatchMode):
    """Records each op of `HOST_READS`, and each index op with a boolean index (a host-sized result)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        indices = args[1] if name in ("index", "index_put", "index_put_", "_index_put_impl_") else ()
        if name in HOST_READS or any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                     for i in indices or ()):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _model(path: Path, family: str) -> tuple[Any, list[torch.Tensor]]:
    config_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).save_pretrained(str(path))
    hf_config = load_hf_config(str(path))
    config = EngineConfig.create(str(path), attention_backend="triton", max_model_len=64)
    model = load_model(config, hf_config, torch.device("cpu"), torch.float32)
    return model, kv_cache_spec(hf_config, 1).allocate(8, 16, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_graph_layout_decode_forward_reads_nothing_on_the_host(tmp_path: Path, family: str) -> None:
    model, caches = _model(tmp_path, family)  # loaded outside inference mode, as the runner loads it
    buffers = DecodeBuffers(StepStaging(4, 4, torch.device("cpu")), torch.zeros((4, 4), dtype=torch.int32), 16)
    ids, positions, metadata = buffers.load_warmup(4)
    reads = HostReads()
    with torch.inference_mode():  # as capture_decode_graphs runs it
        model(ids, positions, caches, metadata)  # the warm-up capture() runs first (lazy state settles)
        before = [cache.clone() for cache in caches]
        with reads:
            hidden = model(ids, positions, caches, metadata)
    assert reads.ops == [], f"{family}: host reads in the captured forward: {reads.ops}"
    assert hidden.shape[0] == 4 and bool(torch.isfinite(hidden).all())
    assert all(torch.equal(a, b) for a, b in zip(caches, before)), "a padding row (slot -1) was written"
