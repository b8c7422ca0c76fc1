"""One compile serves every step: the serve path's kernels do not specialize on the step's counts.

Triton compiles a kernel again for each new specialization key: every integer argument is keyed on being 1 and on
divisibility by 16 unless the kernel lists it in ``do_not_specialize``. The key is computed here the way Triton's
launcher computes it (the binder `create_function_from_signature` builds), for two steps that differ only in such a
count; a fixed argument (a head dim, a stride) still keys, as the control. The warm-up's batch sizes meet every
split-KV segment count a decode batch can pick (docs/kernels.md, "Compiles at start").
"""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from asyncllm.attention.triton import split_kv_segments
from asyncllm.kernels import block_fp8, fused_moe, paged_attention, paged_decode, w4a16
from asyncllm.workers.decode_warmup import warmup_sizes

_TENSOR = torch.zeros(16)

# (kernel, the arguments that vary from step to step, an argument fixed per model)
PER_STEP = [
    (paged_attention._paged_attention_kernel, ("num_reqs",), "head_dim"),
    (paged_decode._decode_segment_kernel, (), "head_dim"),
    (paged_decode._decode_combine_kernel, (), "head_dim"),
    (fused_moe._gate_up_kernel, ("num_pairs",), "H"),
    (fused_moe._down_kernel, ("num_pairs",), "H"),
    (block_fp8._block_fp8_matmul_kernel, ("M",), "K"),
    (w4a16._w4a16_matmul_kernel, ("M",), "K"),
]


def _specialization(kernel, **values: int) -> list:
    """The kernel's specialization key for a launch with ``values`` (every other integer 48, every pointer one
    aligned tensor, every constexpr 16), as the launcher computes it."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)  # the interpreter's
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    args = {}
    for param in jit.params:
        if param.is_constexpr:
            args[param.name] = 16
        elif param.name.endswith("_ptr"):
            args[param.name] = _TENSOR
        else:
            args[param.name] = values.get(param.name, 48)
    return binder(**args)[1]


@pytest.mark.parametrize("kernel, per_step, fixed", PER_STEP, ids=lambda v: getattr(v, "__name__", None))
def test_a_steps_counts_do_not_change_the_kernels_key(kernel, per_step, fixed) -> None:
    for name in per_step:
        keys = [_specialization(kernel, **{name: value}) for value in (1, 16, 37, 4096)]
        assert all(key == keys[0] for key in keys), (name, keys)
    assert _specialization(kernel, **{fixed: 1}) != _specialization(kernel, **{fixed: 37})  # the control


@pytest.mark.parametrize("num_kv_heads, num_sms", [(8, 132), (4, 132), (1, 132), (2, 78), (8, 16)])
@pytest.mark.parametrize("max_num_seqs", [1, 5, 48, 256])
def test_the_warmup_sizes_meet_every_segment_count(num_kv_heads: int, num_sms: int, max_num_seqs: int) -> None:
    def segments(reqs: int) -> int:
        return split_kv_segments(reqs, reqs, num_kv_heads, num_sms)

    sizes = warmup_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    assert {segments(r) for r in sizes} == {segments(r) for r in range(1, max_num_seqs + 1)}


def test_the_warmup_runs_only_for_eager_triton_decodes_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from asyncllm.workers import decode_warmup

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(decode_warmup, "attention_backend_name", lambda model: model.backend)
    eager = dict(device=torch.device("cuda"), cuda_graphs=None, config=SimpleNamespace(pipeline_parallel_size=1),
                 model=SimpleNamespace(backend="triton"), drafter=None)
    assert decode_warmup.warms_up(SimpleNamespace(**eager))
    for change in (dict(device=torch.device("cpu")), dict(cuda_graphs=object()),
                   dict(model=SimpleNamespace(backend="torch_sdpa")),
                   dict(model=SimpleNamespace(backend="triton", cuda_graphs_off="cross-attention states")),
                   dict(model=SimpleNamespace(backend="triton", keeps_request_states=True)),
                   dict(config=SimpleNamespace(pipeline_parallel_size=2))):
        assert not decode_warmup.warms_up(SimpleNamespace(**{**eager, **change})), change
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not decode_warmup.warms_up(SimpleNamespace(**eager))


def test_the_warmup_runs_each_size_once_and_writes_no_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """`warm_up_decodes` on a tiny model on the CPU (torch_sdpa: the driver is under test, not the kernels), the
    GPU checks patched: one forward per `warmup_sizes` size, each that many one-token requests, and the KV cache
    as it was (the warm-up layout writes no KV)."""
    from types import SimpleNamespace

    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_hf_config, load_model
    from asyncllm.models.registry import kv_cache_spec
    from asyncllm.tiny import tiny_checkpoint
    from asyncllm.workers import decode_warmup
    from asyncllm.workers.input_batch import InputBatch

    path = tiny_checkpoint("llama")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, attention_backend="torch_sdpa"), hf_config, torch.device("cpu"),
                       torch.float32)
    kv_caches = kv_cache_spec(hf_config, 1).allocate(3, 4, torch.float32, torch.device("cpu"))
    for cache in kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in kv_caches]
    sizes: list[tuple[int, int]] = []

    def spy(input_ids, positions, caches, metadata):
        sizes.append((input_ids.shape[0], len(metadata.seq_lens_cpu)))
        assert caches is kv_caches
        return model(input_ids, positions, caches, metadata)

    monkeypatch.setattr(decode_warmup, "warms_up", lambda runner: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    batch = InputBatch(max_num_reqs=5, max_num_batched_tokens=8, max_model_len=8, block_size=4,
                       device=torch.device("cpu"))
    runner = SimpleNamespace(model=spy, kv_caches=kv_caches, max_num_seqs=5, max_model_len=8, block_size=4,
                             device=torch.device("cpu"), input_batch=batch)
    decode_warmup.warm_up_decodes(runner)
    assert sizes == [(1, 1), (2, 2), (4, 4), (5, 5)]
    for cache, kept in zip(kv_caches, before):
        torch.testing.assert_close(cache, kept, atol=0, rtol=0)
