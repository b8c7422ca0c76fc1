"""Triton fused mixture-of-experts against `reference.fused_moe`, and the token alignment it runs on."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.fused_moe import align_tokens, fused_moe, moe_config
from kernel_testing import DEVICE, DTYPES, HAS_CUDA, assert_close, randn, requires_gpu

# (atol, rtol): both round the gate/up products, SiLU, the activation, the down product and its weighted
# value to the dtype; the sums of H (then I) products run in another order (float32 here, torch's CPU
# matmul there), which can move one of those roundings by a unit, and the k terms are added in float32
# then rounded once instead of expert by expert in the dtype. Half types: about two units in the last
# place of an O(1) output; float32: summation-order noise.
MOE_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3.2e-2, 3.2e-2)}

H, I, E, K = 40, 24, 5, 2  # odd sizes: masked tails in every dimension of both products


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, seed=seed, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, seed=seed + 1, scale=inter**-0.5)
    return w13, w2


def _routing(kind: str, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids) for ``tokens`` tokens, ``K`` slots, ``E`` experts."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), dim=-1)
    if kind == "unused_expert":  # k distinct experts per token, never expert 1
        experts = torch.tensor([0, 2, 3, 4])
        ids = torch.stack([experts[torch.randperm(4, generator=gen)[:K]] for _ in range(tokens)])
    elif kind == "expert_parallel":  # int32 ids; about a third belong to other ranks (< 0 or >= E)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
        foreign = torch.rand(tokens, K, generator=gen) < 1 / 3
        ids = torch.where(foreign, torch.tensor([-1, E, E + 7])[torch.randint(0, 3, (tokens, K), generator=gen)], ids)
        ids = ids.to(torch.int32)
    else:  # one_expert: every (token, slot) on expert 3, a group of several blocks
        ids = torch.full((tokens, K), 3)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("routing", ["unused_expert", "expert_parallel", "one_expert"])
def test_fused_moe_matches_reference(dtype: torch.dtype, tokens: int, routing: str) -> None:
    hidden = randn(tokens, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    topk_weights, topk_ids = _routing(routing, tokens, seed=tokens)
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    assert out.shape == (tokens, H) and out.dtype == dtype
    assert_close(out, reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids), MOE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, routing", [(7, "expert_parallel"), (33, "one_expert")])
def test_experts_without_a_gate_match_reference(dtype: torch.dtype, tokens: int, routing: str) -> None:
    """Nemotron 3's experts: w13 holds the up rows alone, ``down(relu(up x) ** 2)``."""
    hidden = randn(tokens, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    up = w13[:, :I].contiguous()
    topk_weights, topk_ids = _routing(routing, tokens, seed=tokens)
    expected = reference.fused_moe(hidden, up, w2, topk_weights, topk_ids, activation="relu2")
    token, slot = 0, 0
    expert = int(topk_ids[token, slot]) if routing == "one_expert" else None
    if expert is not None:  # the meaning, spelled out for one token's experts
        rows = [torch.relu(hidden[token] @ up[int(e)].t()).square() @ w2[int(e)].t() * w for e, w in
                zip(topk_ids[token], topk_weights[token])]
        assert_close(expected[token].float(), sum(r.float() for r in rows), MOE_TOL[dtype])
    assert_close(fused_moe(hidden, up, w2, topk_weights, topk_ids, activation="relu2"), expected, MOE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_experts_match_reference(dtype: torch.dtype) -> None:
    """Gemma 4's experts: ``down(gelu_tanh(gate x) * up x)``."""
    hidden = randn(13, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    topk_weights, topk_ids = _routing("expert_parallel", 13, seed=3)
    expected = reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation="gelu_tanh")
    token = 0
    rows = [reference.gelu_tanh_and_mul(hidden[token] @ w13[int(e)].t()) @ w2[int(e)].t() * w
            for e, w in zip(topk_ids[token], topk_weights[token]) if 0 <= int(e) < E]
    assert_close(expected[token].float(), sum(r.float() for r in rows), MOE_TOL[dtype])
    assert not torch.allclose(expected, reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids))  # not SiLU's
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation="gelu_tanh")
    assert_close(out, expected, MOE_TOL[dtype])


def _int_experts(num_experts: int, hidden: int, inter: int, bits: int, group: int, dtype: torch.dtype,
                 gated: bool = True) -> tuple[torch.Tensor, torch.Tensor, reference.IntExperts]:
    """Random packed AWQ / GPTQ-style experts: (w13 ``[E, 2I, H/p]``, w2 ``[E, H, I/p]`` int32, their scales and
    zero points)."""
    gen = torch.Generator().manual_seed(bits + group)
    pack = 32 // bits

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 1 << bits, (num_experts, rows, cols), generator=gen, dtype=torch.int32)
        words = torch.zeros(num_experts, rows, cols // pack, dtype=torch.int32)
        for i in range(pack):
            words |= q[..., i::pack] << (bits * i)
        groups = -(-cols // group)
        scales = (torch.rand(num_experts, rows, groups, generator=gen) * 2 + 0.5) / (1 << bits) / cols**0.5
        zeros = torch.randint(0, 1 << bits, (num_experts, rows, groups), generator=gen).float()
        return words.to(DEVICE), scales.to(dtype).to(DEVICE), zeros.to(dtype).to(DEVICE)

    w13, s13, z13 = packed((2 if gated else 1) * inter, hidden)
    w2, s2, z2 = packed(hidden, inter)
    return w13, w2, reference.IntExperts(s13, z13, s2, z2, bits, group)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, group, activation", [(4, 8, "silu"), (4, 16, "gelu_tanh"), (8, 8, "silu"),
                                                     (4, 8, "relu2")])
def test_int_experts_match_reference(dtype: torch.dtype, bits: int, group: int, activation: str) -> None:
    """AWQ / GPTQ experts kept packed (the GPU's layout): each tile's values unpacked, less their zero points, times
    their scales, rounded to the dtype, then multiplied; the reference dequantizes whole matrices the same way."""
    h, inter = 48, 32  # multiples of the packs; groups of 8 / 16 inputs
    hidden = randn(11, h, dtype=dtype, seed=0)
    w13, w2, ints = _int_experts(E, h, inter, bits, group, dtype, gated=activation != "relu2")
    topk_weights, topk_ids = _routing("expert_parallel", 11, seed=4)
    expected = reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=activation, int_experts=ints)
    dense13 = torch.stack([reference.dequantize_int_expert(w13[e].cpu(), ints.w13_scales[e].cpu(),
                                                           ints.w13_zeros[e].cpu(), bits, group) for e in range(E)])
    dense2 = torch.stack([reference.dequantize_int_expert(w2[e].cpu(), ints.w2_scales[e].cpu(),
                                                          ints.w2_zeros[e].cpu(), bits, group) for e in range(E)])
    plain = reference.fused_moe(hidden, dense13.to(dtype).to(DEVICE), dense2.to(dtype).to(DEVICE), topk_weights,
                                topk_ids, activation=activation)
    assert_close(expected, plain, MOE_TOL[dtype])  # the reference's int path: its float path, dequantized weights
    assert expected.abs().max() > 0.01
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=activation, int_experts=ints)
    assert_close(out, expected, MOE_TOL[dtype])


def test_int_experts_arguments_are_checked() -> None:
    hidden = randn(3, 48, dtype=torch.float32, seed=0)
    w13, w2, ints = _int_experts(E, 48, 32, 4, 8, torch.float32)
    topk_weights, topk_ids = _routing("one_expert", 3, seed=1)
    with pytest.raises(ValueError, match="w13_scales must be"):
        fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=ints._replace(group=16))
    with pytest.raises(ValueError, match="hidden size 44"):
        fused_moe(hidden[:, :44].contiguous(), w13, w2, topk_weights, topk_ids, int_experts=ints)


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """(w13, w2) in float8_e4m3fn and their `Fp8Experts`: each expert's matrices quantized block by block."""
    from asyncllm.models.fp8_checkpoint import quantize_fp8_blocks

    quantized = [[quantize_fp8_blocks(w[e].float().cpu(), block) for e in range(w.shape[0])] for w in (w13, w2)]
    (q13, s13), (q2, s2) = ((torch.stack([q for q, _ in parts]).to(DEVICE), torch.stack([s for _, s in parts])
                             .to(DEVICE)) for parts in quantized)
    return q13, q2, reference.Fp8Experts(s13, s2, block)


# bfloat16 / float16: as MOE_TOL (the same roundings, products in another order); float32: the fp8 products
# exact in float32 either way, summed in another order.
FP8_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3.2e-2, 3.2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing, activation, block", [
    ("expert_parallel", "silu", (16, 16)),  # H 40 and I 24: partial scale blocks in both products
    ("one_expert", "silu", (32, 16)),  # the gate's and the up rows' blocks meet inside a 32-row block
    ("unused_expert", "relu2", (16, 32)),
    ("expert_parallel", "silu", (I, 128)),  # per-tensor experts' block: one group wider than H, the down in 2 blocks
    ("one_expert", "silu", (1, 128)),  # compressed-tensors' per-row experts: a scale per row, one group wider than H
])
def test_block_fp8_experts_match_reference(dtype: torch.dtype, routing: str, activation: str,
                                           block: tuple[int, int]) -> None:
    """Block-fp8 experts (DeepSeek-V3's, Qwen3-MoE-FP8's): inputs quantized per token group, each product scaled
    by its groups' and blocks' scales."""
    hidden = randn(9, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    w13 = w13 if activation == "silu" else w13[:, :I].contiguous()
    q13, q2, fp8 = _fp8_experts(w13, w2, block)
    topk_weights, topk_ids = _routing(routing, 9, seed=5)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, activation=activation, fp8=fp8)
    plain = reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=activation)
    assert_close(expected, plain, (0.2, 0.2))  # fp8 is close to the float experts, not equal
    assert not torch.equal(expected, plain)
    out = fused_moe(hidden, q13, q2, topk_weights, topk_ids, activation=activation, fp8=fp8)
    assert_close(out, expected, FP8_TOL[dtype])


WIDE_H, WIDE_I = 300, 136
"""Past one 256-column group: the gate/up product's K (300) in 3 steps of 128, the last 44 wide; the down's in 2."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [
    (16, 256),  # GROUP_K = 2 * BLOCK_K: H in two groups (the last partial), I in one
    (1, WIDE_H),  # one scale per row and per token (compressed-tensors' channel experts): a group covering all of K
])
def test_fp8_scale_groups_wider_than_the_k_step(dtype: torch.dtype, block: tuple[int, int]) -> None:
    """A scale group of several K steps: each step scaled by its group's scales (``k0 // GROUP_K``), the inputs
    quantized per token in the same groups."""
    hidden = randn(9, WIDE_H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, WIDE_H, WIDE_I, dtype, seed=1)
    q13, q2, fp8 = _fp8_experts(w13, w2, block)
    assert fp8.w13_scale.shape[2] == (2 if block[1] == 256 else 1) and fp8.w2_scale.shape[2] == 1
    topk_weights, topk_ids = _routing("expert_parallel", 9, seed=5)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8)
    assert_close(expected, reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids), (0.2, 0.2))
    assert_close(fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8), expected, FP8_TOL[dtype])


@pytest.mark.parametrize("hidden_size, inter, block", [
    (H, I, (1, H)),  # one scale per row, H = 40: no power of two, one masked step of 64
    (H, I, (I, H)),  # per-tensor experts' block at H 40, I 24
    (136, 300, (1, 300)),  # H < I: the gate/up product's K inside the group, the down's in three steps
    (256, 96, (96, 256)),  # a tensor-parallel rank's I under a per-tensor block
])
def test_fp8_whole_row_groups_at_any_width(hidden_size: int, inter: int, block: tuple[int, int]) -> None:
    """A group covering all of K (`fp8_experts.whole_row_group`: the larger of H and I) at widths that are no power
    of two or below the step, and with H < I: one scale per token and row, float32 against the reference."""
    hidden = randn(5, hidden_size, dtype=torch.float32, seed=3)
    w13, w2 = _weights(E, hidden_size, inter, torch.float32, seed=4)
    q13, q2, fp8 = _fp8_experts(w13, w2, block)
    assert fp8.w13_scale.shape[2] == 1 and fp8.w2_scale.shape[2] == 1
    topk_weights, topk_ids = _routing("expert_parallel", 5, seed=6)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8)
    assert_close(fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8), expected, FP8_TOL[torch.float32])


def test_fp8_scale_groups_must_fit_the_k_step() -> None:
    """A group wider than the step must be a multiple of it or cover all of K (300 and 136 here)."""
    hidden = randn(3, WIDE_H, dtype=torch.float32, seed=0)
    w13, w2 = _weights(E, WIDE_H, WIDE_I, torch.float32, seed=1)
    q13, q2, fp8 = _fp8_experts(w13, w2, (1, 200))
    topk_weights, topk_ids = _routing("one_expert", 3, seed=1)
    with pytest.raises(ValueError, match=r"a multiple of 128, or one covering all of K \(at least 300\)"):
        fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8)


GPT_OSS_SWIGLU = reference.ClampedSwiglu(alpha=1.702, limit=0.8)
"""gpt-oss's activation with the clamp low enough (gate and up are about N(0, 1) here) to cut about 40% of them."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing, down_bias", [("expert_parallel", True), ("unused_expert", False)])
def test_gpt_oss_experts_match_reference(dtype: torch.dtype, routing: str, down_bias: bool) -> None:
    """Biases and the clamped SwiGLU (gpt-oss): the gate/up bias alone is a tensor-parallel rank other than 0."""
    hidden = randn(7, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    w13_bias = randn(E, 2 * I, dtype=dtype, seed=2, scale=0.5)
    w2_bias = randn(E, H, dtype=dtype, seed=3, scale=0.5) if down_bias else None
    topk_weights, topk_ids = _routing(routing, 7, seed=4)
    args = (hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, GPT_OSS_SWIGLU)
    expected = reference.fused_moe(*args)
    assert not torch.equal(expected, reference.fused_moe(*args[:7]))  # the clamp bites
    assert_close(fused_moe(*args), expected, MOE_TOL[dtype])


def test_fused_moe_strided_inputs_and_wider_routing() -> None:
    """hidden a column slice of a wider tensor, expert weights slices of larger stacks, k = 3 of 9 experts,
    non-contiguous routing tensors, H = 70 over several K steps: only the last dims must be contiguous."""
    tokens, hidden_size, inter, experts, k = 20, 70, 36, 9, 3
    hidden = randn(tokens, hidden_size + 6, dtype=torch.float32, seed=3)[:, 3:3 + hidden_size]
    w13, w2 = _weights(experts + 2, hidden_size, inter, torch.float32, seed=4)
    w13, w2 = w13[1:1 + experts], w2[2:]
    gen = torch.Generator().manual_seed(5)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    topk_ids = topk_ids.T.contiguous().to(DEVICE).T  # [tokens, k] views with column-major strides
    topk_weights = torch.rand(k, tokens, generator=gen).to(DEVICE).T
    assert not (hidden.is_contiguous() or topk_ids.is_contiguous() or topk_weights.is_contiguous())
    assert_close(fused_moe(hidden, w13, w2, topk_weights, topk_ids),
                 reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids), MOE_TOL[torch.float32])


def test_fused_moe_without_tokens_or_local_experts() -> None:
    w13, w2 = _weights(E, H, I, torch.float32, seed=6)
    empty = fused_moe(torch.empty(0, H, device=DEVICE), w13, w2, torch.empty(0, K, device=DEVICE),
                      torch.empty(0, K, dtype=torch.int64, device=DEVICE))
    assert empty.shape == (0, H)
    hidden = randn(4, H, dtype=torch.float32, seed=7)
    foreign = torch.tensor([[-1, E]] * 4, device=DEVICE)  # every expert on another rank: zeros
    assert torch.equal(fused_moe(hidden, w13, w2, torch.ones(4, K, device=DEVICE), foreign), torch.zeros_like(hidden))


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_tokens_pads_each_expert_group(block_m: int) -> None:
    gen = torch.Generator().manual_seed(8)
    tokens, k, experts = 37, 4, 6
    topk_ids = torch.randint(-2, experts + 2, (tokens, k), generator=gen)  # some foreign, expert 5 maybe unused
    topk_ids[:, 0] = 2  # one busy expert
    aligned = align_tokens(topk_ids.to(DEVICE), experts, block_m)
    pairs, block_experts = aligned.sorted_pairs.cpu(), aligned.block_experts.cpu()
    total = int(aligned.total_rows.item())
    num_pairs, flat = tokens * k, topk_ids.reshape(-1)
    counts = torch.stack([(flat == e).sum() for e in range(experts)])
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert pairs.shape[0] == block_experts.shape[0] * block_m >= num_pairs + min(experts, num_pairs) * (block_m - 1)
    assert (block_experts[total // block_m:] == experts).all()  # past the total: no expert, the kernels return
    assert (pairs[total:] == num_pairs).all()
    local = [int(p) for p in pairs[:total] if p < num_pairs]
    assert sorted(local) == [p for p in range(num_pairs) if 0 <= flat[p] < experts]  # each local pair once
    used_blocks = total // block_m
    for block in range(used_blocks):
        rows = pairs[block * block_m:(block + 1) * block_m]
        real = rows[rows < num_pairs]
        assert len(real) > 0 and (flat[real] == block_experts[block]).all()
        assert (rows[:len(real)] == real).all()  # padding at the end of a block
        if block + 1 < used_blocks and block_experts[block + 1] == block_experts[block]:
            assert len(real) == block_m  # ... of the group's last block only
    starts = [b for b in range(used_blocks) if b == 0 or block_experts[b] != block_experts[b - 1]]
    assert block_experts[starts].tolist() == sorted(set(block_experts[:used_blocks].tolist()))  # expert order
    assert local == sorted(local, key=lambda p: (int(flat[p]), p))  # stable: token order within a group


def test_moe_config_grows_the_row_block_with_rows_per_expert() -> None:
    assert moe_config(8, 128, torch.bfloat16, on_gpu=True).block_m == 16  # a decode token: 8 rows, 128 experts
    assert moe_config(2048, 128, torch.bfloat16, on_gpu=True).block_m == 16  # 256 tokens: 16 rows per expert
    assert moe_config(65536, 128, torch.bfloat16, on_gpu=True).block_m == 64  # a prefill
    assert moe_config(65536, 128, torch.bfloat16, on_gpu=False) == (16, 16, 16, 4, 1)  # the interpreter


def test_launcher_rejects_bad_arguments() -> None:
    hidden = randn(3, H, dtype=torch.float32, seed=9)
    w13, w2 = _weights(E, H, I, torch.float32, seed=10)
    ids, weights = torch.zeros(3, K, dtype=torch.int64, device=DEVICE), torch.ones(3, K, device=DEVICE)
    bad = {
        "hidden must be": dict(hidden=hidden.to(torch.int32)),
        "hidden must have 2 dims": dict(hidden=hidden[None]),
        "hidden must be contiguous": dict(hidden=hidden.T.contiguous().T),
        "w13 must be": dict(w13=w13[:, :, :-1]),
        "w13 must be .* of torch.float32": dict(w13=w13.half()),
        "w2 must be": dict(w2=w2[:, :, :-1]),
        "w2 must be contiguous": dict(w2=w2.transpose(1, 2).contiguous().transpose(1, 2)),
        "topk_ids must be int32 or int64": dict(topk_ids=ids.float()),
        "topk_ids must be \\[3, k\\]": dict(topk_ids=ids[:2]),
        "topk_weights must be float32": dict(topk_weights=weights.half()),
        "topk_weights must be \\[3, 2\\]": dict(topk_weights=weights[:, :1]),
    }
    for message, change in bad.items():
        args = dict(hidden=hidden, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids) | change
        with pytest.raises(ValueError, match=message):
            fused_moe(**args)
    if HAS_CUDA:
        with pytest.raises(ValueError, match="different devices"):
            fused_moe(hidden, w13, w2, weights.cpu(), ids)


def test_the_micro_benchmark_times_kernel_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncllm bench kernels`' fused_moe rows on a tiny shape (each call run once, not timed)."""
    from asyncllm.bench import kernels as bench

    calls = []
    monkeypatch.setattr(bench, "time_ms", lambda fn: calls.append(fn()) or 0.001)
    shape = {"hidden_size": 24, "moe_intermediate_size": 20, "num_experts": 6, "num_experts_per_tok": 2}
    rows = bench._fused_moe(shape, torch.float32, 1e12, device=str(DEVICE))
    assert [r["shape"] for r in rows] == ["1x24x20", "64x24x20", "256x24x20"]
    assert all(r["speedup"] == 1.0 for r in rows) and len(calls) == 6
    for kernel, torch_path in zip(calls[0::2], calls[1::2]):
        assert_close(kernel, torch_path, MOE_TOL[torch.float32])
    assert set(bench.MOE_SHAPE.values()) == {2048, 768, 128, 8}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 64, 256, 2048])
def test_fused_moe_real_shapes(tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's experts (H 2048, I 768, 128 experts, top 8), under torch's sync check."""
    hidden_size, inter, experts, k = 2048, 768, 128, 8
    hidden = randn(tokens, hidden_size, dtype=dtype, seed=11)
    w13, w2 = _weights(experts, hidden_size, inter, dtype, seed=12)
    logits = randn(tokens, experts, dtype=torch.float32, seed=13)
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids), MOE_TOL[dtype])


@pytest.mark.gpu
@requires_gpu
def test_fused_moe_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed with other routings (foreign ids included): the padded total is read on the device."""
    tokens, dtype = 16, torch.bfloat16
    hidden = randn(tokens, 256, dtype=dtype, seed=14)
    w13, w2 = _weights(32, 256, 96, dtype, seed=15)
    topk_weights, topk_ids = torch.ones(tokens, 4, device=DEVICE), torch.zeros(tokens, 4, dtype=torch.int64,
                                                                                device=DEVICE)
    fused_moe(hidden, w13, w2, topk_weights, topk_ids)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        topk_ids.copy_(torch.randint(-4 * seed, 32 + 4 * seed, (tokens, 4), generator=gen))
        topk_weights.copy_(torch.rand(tokens, 4, generator=gen))
        graph.replay()
        assert_close(out, reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids), MOE_TOL[dtype])
