"""On a CUDA device (skipped without one): a Qwen3-0.6B-shape model in bfloat16, with transformers'
random initialisation loaded into both, gives logits close to transformers' own.

Tolerance (bf16 through 28 layers, different kernels and summation orders): the mean
absolute difference is under 2% of the logits' standard deviation, the largest under
15%, and the argmax agrees on at least 95% of positions.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, hf_logits

from asyncllm.bench.model import resolve_bench_model
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import load_hf_config
from asyncllm.models.registry import get_model_class, kv_cache_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SEQ_LENS = [37, 120, 300]
CHUNKED = [[37, 64, 100], [0, 56, 100], [0, 0, 100]] + [[1, 1, 1]] * 4


@pytest.fixture(scope="module")
def qwen3_pair():
    from transformers import AutoModelForCausalLM

    path = resolve_bench_model(None, "qwen3-0.6b").path
    hf_config = load_hf_config(path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    return path, hf_config, hf_model


@pytest.mark.parametrize("backend", ["triton", "torch_sdpa"])
def test_bf16_logits_close_to_transformers(qwen3_pair, backend: str) -> None:
    from asyncllm.attention.selector import get_attention_backend

    path, hf_config, hf_model = qwen3_pair
    device = torch.device("cuda")
    with torch.device(device):
        model = get_model_class(hf_config)(
            hf_config, dtype=torch.bfloat16, tp=TensorParallel(),
            attn_backend=get_attention_backend(backend, device, torch.bfloat16), max_position=4096,
        )
        model.load_weights(hf_model.state_dict().items())
        gen = torch.Generator().manual_seed(1)
        sequences = [torch.randint(10, hf_config.vocab_size, (n,), generator=gen).tolist() for n in SEQ_LENS]
        spec = kv_cache_spec(hf_config, 1)
        run = PagedRun(model.eval(), [s + [11, 12, 13, 14] for s in sequences], block_size=16)
        run.new_kv_caches(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
        all_logits = run.run(CHUNKED)
        for tokens, logits in zip(run.sequences, all_logits):
            expected = hf_logits(hf_model, tokens)
            diff = (logits.float() - expected).abs()
            std = expected.std()
            assert diff.mean() < 0.02 * std and diff.max() < 0.15 * std, (diff.mean() / std, diff.max() / std)
            agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean()
            assert agree >= 0.95, agree
