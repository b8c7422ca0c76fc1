"""The tiny test models' shapes per family (asyncllm/tiny.py builds them): every kind of layer a family has, small."""

from __future__ import annotations

from typing import Any

_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=96, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    # Phi-3.5-MoE: SparseMixer's top 2 of 6, biases on attention and the LM head, a jitter that masks some experts
    "phimoe": dict(num_local_experts=6, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                   router_jitter_noise=0.1),
    "flex_olmo": dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
    "olmoe": dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
    # DBRX: q, k, v clamped, the top 2 of 6 divided by their 2-norm (the releases: 1-norm), its rope base twice
    "dbrx": dict(attn_config=dict(kv_n_heads=2, clip_qkv=1.0, rope_theta=500_000.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=6, moe_top_k=2, moe_normalize_expert_weights=2.0),
                 rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
    "hunyuan_v1_moe": dict(num_experts=6, moe_topk=2, intermediate_size=48),
    "ernie4_5_moe": dict(moe_num_experts=6, moe_k=2, moe_intermediate_size=24, moe_num_shared_experts=1,
                         moe_layer_start_index=1, moe_layer_interval=1),
    "qwen3_5_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                        shared_expert_intermediate_size=48),
    "minimax_m2": dict(num_local_experts=6, num_experts_per_tok=2, rotary_dim=8),
    "qwen3_next": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0]),
}
"""The tiny MoE models' experts: small, several per token, one family without renormalised weights."""

_DEEPSEEK_LATENT = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_group=4, topk_group=2)
_DEEPSEEK_SHAPES: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(_DEEPSEEK_LATENT, q_lora_rank=None, topk_method="group_limited_greedy",
                        routed_scaling_factor=1.5, norm_topk_prob=False),
    # GLM-4.7-Flash: V3's latent attention and experts, its dense layers listed, values as wide as keys
    "glm4_moe_lite": dict({k: v for k, v in _DEEPSEEK_LATENT.items() if k != "first_k_dense_replace"},
                          q_lora_rank=24, v_head_dim=24, routed_scaling_factor=1.8, norm_topk_prob=True,
                          mlp_layer_types=["dense", "sparse"]),
    # Mistral 4: V3's latent attention with a query temperature past 16 positions, softmax grouped routing
    "mistral4": dict(_DEEPSEEK_LATENT, q_lora_rank=24, v_head_dim=24, routed_scaling_factor=1.5, norm_topk_prob=True,
                     moe_intermediate_size=24,  # its experts are saved fused: not square
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.2,
                                      "partial_rotary_factor": 8 / 24}),
    "deepseek_v3": dict(_DEEPSEEK_LATENT, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0}),
    # DeepSeek-V3.2: V3's layers with the lightning indexer, its top 6 keys (test prompts outrun them); GLM-5: the
    # same under GLM's names, its indexer's rope interleaved, the second layer reusing the first's choice
    "deepseek_v32": dict(_DEEPSEEK_LATENT, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True,
                         index_topk=6, index_n_heads=16, index_head_dim=16,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 512, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    "glm_moe_dsa": dict({k: v for k, v in _DEEPSEEK_LATENT.items() if k != "first_k_dense_replace"},
                        q_lora_rank=24, v_head_dim=24, routed_scaling_factor=1.8, norm_topk_prob=True,
                        mlp_layer_types=["dense", "sparse"], index_topk=6, index_n_heads=16, index_head_dim=16,
                        indexer_types=["full", "shared"]),
    # Youtu-LLM: V3's latent attention over dense MLPs
    "youtu": dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24),
    # MiniCPM3: Youtu's shapes, muP's scalars far from 1, LongRoPE over 64 positions (short and long factors apart)
    "minicpm3": dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24,
                     scale_emb=12.0, scale_depth=0.3, dim_model_base=32, rope_parameters={"rope_type": "longrope",
                     "rope_theta": 10_000.0, "original_max_position_embeddings": 64,
                     "short_factor": [1.0, 1.3, 1.8, 2.5], "long_factor": [2.0, 4.0, 8.0, 16.0]}),
    # LongCat-Flash: two decoder layers (four latent attention blocks), 6 routed experts and 2 identity ones, top 3
    "longcat_flash": dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=12,
                          q_lora_rank=24, num_hidden_layers=4, n_routed_experts=6, zero_expert_num=2, moe_topk=3,
                          expert_ffn_hidden_size=32, routed_scaling_factor=2.5,
                          rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # Kimi-Linear: a KDA layer (4 heads of 16, a decay per key channel) with the dense MLP, latent attention without
    # positions with experts, a KDA layer with experts
    "kimi_linear": dict({k: v for k, v in _DEEPSEEK_LATENT.items() if k != "n_routed_experts"}, num_local_experts=8,
                        q_lora_rank=None, routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=3,
                        linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 3],
                                                full_attn_layers=[2])),
}
"""DeepSeek's latent attention (V2: the full-rank query; V3: the low-rank one, YaRN with its softmax mscale, the
interleaved rope), one dense layer, then grouped routing over 8 experts and a shared one."""

_DEEPSEEK_EXPERTS = dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                         first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5, attention_bias=True)
_QWEN3_5_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2)
_GEMMA4_ATTENTION: dict[str, Any] = dict(sliding_window=8, global_head_dim=32, num_global_key_value_heads=1,
                                         attention_k_eq_v=True)

_LAYER_SHAPES: dict[str, dict[str, Any]] = {
    # the LayerNorm families: a partial rotary each (Phi's 0.5, StableLM's and GPT-NeoX's 0.25, Nemotron's 0.5)
    "phi": dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
    "stablelm": dict(use_qkv_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                         "partial_rotary_factor": 0.25}),
    "nemotron": dict(attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
    # learned positions: GPT-2, GPTBigCode (one KV head: multi_query), OPT (ReLU MLP), GPT-J (an interleaved rotary
    # over half of each head); the ones without a KV head count of their own
    "gpt2": dict(num_key_value_heads=None), "gpt_bigcode": dict(num_key_value_heads=None),
    "opt": dict(num_key_value_heads=None, ffn_dim=128, word_embed_proj_dim=64),
    "gptj": dict(num_key_value_heads=None, rotary_dim=8),
    # OLMo (0424-style: q, k, v clamped), Jais 2 (biases everywhere), CWM (a sliding layer after each full one)
    "olmo": dict(clip_qkv=0.5), "jais2": dict(attention_bias=True, mlp_bias=True),
    "cwm": dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
    # Falcon 40B-style: parallel attention and MLP after their own norms, two KV heads (each with its two queries
    # in the fused q/k/v), biases on
    "falcon": dict(num_key_value_heads=None, new_decoder_architecture=True, ffn_hidden_size=128, bias=True,
                   parallel_attn=True),
    # MPT: q, k, v clamped, its own softmax scale (transformers reads no alibi_bias_max: the default 8 stays)
    "mpt": dict(attn_config=dict(clip_qkv=1.5, softmax_scale=0.3)),
    "gpt_neox": dict(num_key_value_heads=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}),
    # GLM-4.5: biased q/k/v, per-head q/k norms, half of each head rotated (its default), DeepSeek-V3's routing
    "glm4_moe": dict(_DEEPSEEK_EXPERTS, use_qk_norm=True),
    # dots.llm1: the same experts under Qwen3's attention, a sliding layer first
    "dots1": dict(_DEEPSEEK_EXPERTS, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # Qwen3.5 / Qwen3-Next: a Gated DeltaNet layer (two key heads serving four value heads), then gated attention
    "qwen3_5": _QWEN3_5_LINEAR, "qwen3_5_moe": _QWEN3_5_LINEAR, "qwen3_next": _QWEN3_5_LINEAR,
    # Granite 4.0: a Mamba2 layer (4 heads in 2 groups), attention without positions, experts and the shared MLP
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_n_groups=2,
                             mamba_d_state=8, mamba_d_head=32, mamba_d_conv=4, mamba_expand=2,
                             shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                             position_embedding_type=None),
    # Bamba: a Mamba2 layer, then attention rotating half of each head
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=32,
                  mamba_d_conv=4, mamba_expand=2),
    # Nemotron-H: Mamba2, Nemotron 3's experts (grouped sigmoid routing, no gate, a shared MLP), attention without
    # positions, a squared-ReLU MLP
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=4,
                       mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, n_routed_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
                       n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    # LFM2: a gated short-convolution layer, then attention; its MLP width adjusted (128 -> 85 -> 96)
    # Falcon-H1: Mamba2 beside attention in each layer, every muP multiplier away from 1
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                      mamba_d_conv=4, mamba_chunk_size=16, mlp_multipliers=[1.5, 0.7], key_multiplier=0.8,
                      attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                      ssm_multipliers=[1.1, 0.9, 1.3, 0.8, 1.2], ssm_in_multiplier=0.95, ssm_out_multiplier=1.05,
                      embedding_multiplier=2.0, lm_head_multiplier=0.5),
    # Solar Open: GLM-4.5's experts in every layer (softmax-free grouped sigmoid routing, a shared expert), Llama
    # attention
    "solar_open": dict(moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                       n_group=2, topk_group=1, routed_scaling_factor=1.5),
    # AFMoE (Trinity): a sliding layer (rotating) with a dense MLP, then a global one (no positions) with experts
    # (sigmoid scores, the bias choosing, scaled) and a shared expert; embeddings times sqrt(hidden) (muP)
    "afmoe": dict(global_attn_every_n_layers=2, sliding_window=8, num_dense_layers=1, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=24, num_shared_experts=1, route_scale=2.5,
                  mup_enabled=True),
    # Sarvam-30B: GLM-4.5's layers (biased fused q/k/v, q/k norms, a dense first layer), the whole head rotated,
    # saved under Sarvam's names
    "sarvam_moe": dict(_DEEPSEEK_EXPERTS, use_qk_norm=True),
    # Jamba: a Mamba (v1) layer with a dense MLP, then attention without positions with experts
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=8),
    # MiniMax-Text-01: a lightning-attention layer, then softmax attention, experts in both; every residual weight
    # away from 1; transformers' own prefill blocks of 8 tokens (test prompts span several)
    "minimax": dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
                    block_size=8, linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.2,
                    full_attn_alpha_factor=1.3, full_attn_beta_factor=0.8, mlp_alpha_factor=1.1, mlp_beta_factor=0.7),
    # LFM2-MoE: a conv layer with a dense MLP, then attention with experts (sigmoid scores, the bias choosing)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=6, num_experts_per_tok=2,
                     moe_intermediate_size=24, routed_scaling_factor=1.5),
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=3, block_multiple_of=32,
                 block_ffn_dim_multiplier=1.0),
    # Zamba2: Mamba2 layers, three invocations of two shared blocks (block 0 twice, with its own adapters each
    # time) on the embeddings concatenated to the stream, rotary on; two heads of 2 x 64 / 2 (the adapters need as
    # many KV heads; ``head_dim`` given as the config derives it, since the default one would override it)
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid", "hybrid"],
                   num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, head_dim=64, n_mamba_heads=4,
                   mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, num_mem_blocks=2,
                   use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True),
    # EXAONE MoE: an 8-token sliding layer (rotating) and a global one (no positions), a dense first layer, then
    # DeepSeek-V3's experts
    "exaone_moe": dict(moe_intermediate_size=32, num_experts=8, num_shared_experts=1, num_experts_per_tok=2,
                       n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, sliding_window=8,
                       sliding_window_pattern=2, mlp_layer_types=["dense", "sparse"]),
    # Gemma 4 (E2B/E4B-style): sliding layers of 4 heads x 16 over 2 KV heads, global ones with one 32-wide KV head
    # whose values are their keys, rotated by the proportional rope; the last two layers share the first two's KV
    # caches and have double-wide MLPs; per-layer inputs; capped logits
    "gemma4": dict(_GEMMA4_ATTENTION, num_hidden_layers=4, num_kv_shared_layers=2, use_double_wide_mlp=True,
                   hidden_size_per_layer_input=8, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    # Gemma 3n (E2B/E4B-style): four AltUp streams, LAuReL, per-layer inputs from a table shorter than the vocabulary,
    # the first two layers' MLP gates sparsified, the last two layers sharing the first two's KV caches
    "gemma3n": dict(num_hidden_layers=4, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2,
                    sliding_window=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, laurel_rank=8,
                    altup_num_inputs=4, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
                    intermediate_size=[128, 128, 96, 96], final_logit_softcapping=30.0),
    # Gemma 4 26B-A4B-style: GELU experts (a router of its own) beside the dense MLP in each layer
    "gemma4_moe": dict(_GEMMA4_ATTENTION, enable_moe_block=True, num_experts=6, top_k_experts=2,
                       moe_intermediate_size=24, hidden_size_per_layer_input=0,
                       layer_types=["sliding_attention", "full_attention"]),
    # Llama 4: a rotary layer chunked by 8 with its q/k L2 norm, then a layer without positions (its query scaled by
    # the temperature, floor 4) and experts: one routed (its input scaled) and the shared one
    "llama4": dict(no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=4, attn_scale=0.1, moe_layers=[1],
                   num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96, use_qk_norm=True,
                   attn_temperature_tuning=True),
}
"""Each newer family's layer mix, small: every kind of layer it has appears in the tiny model's two (or four)."""

_GEMMA_SHAPES: dict[str, dict[str, Any]] = {
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
                   final_logit_softcapping=30.0),
    "vaultgemma": dict(sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
                       final_logit_softcapping=30.0),
    "gemma3": dict(sliding_window=8, query_pre_attn_scalar=32, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    }),
}
"""The tiny Gemma models: a window of 8 tokens (so test prompts outrun it), an attention scale that is not
``head_dim ** -0.5``, Gemma 2's caps low enough to change the scores, Gemma 3's two ropes (the global one
scaled, as in the 4B-27B checkpoints); sliding and global layers alternate."""

_OLMO3_SHAPE: dict[str, Any] = dict(sliding_window=8, rope_parameters={
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                       "rope_theta": 500_000.0, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2},
})
"""The tiny OLMo 3: a window of 8 tokens and a different rope per layer type (the full layers' YaRN-scaled, as the
long-context checkpoints'); sliding and full layers alternate."""

_SMOLLM3_SHAPE: dict[str, Any] = dict(no_rope_layers=[1, 0])
"""The tiny SmolLM3: its second layer uses no positions (NoPE)."""

_EXAONE4_SHAPE: dict[str, Any] = dict(sliding_window=8, sliding_window_pattern=2)
"""The tiny EXAONE 4: an 8-token window in its first layer, the second full and without positions."""

_BIAS_SHAPES: dict[str, dict[str, Any]] = {
    "ernie4_5": dict(use_bias=True), "helium": dict(attention_bias=True), "seed_oss": dict(attention_bias=True, attention_out_bias=False),
    "cohere": dict(logit_scale=0.5), "cohere2": dict(logit_scale=0.5, sliding_window=8, sliding_window_pattern=2),
    "ministral": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "starcoder2": dict(sliding_window=8),
    "hunyuan_v1_dense": dict(rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10_000.0,
                                              "factor": 1.0}),
    "hunyuan_v1_moe": dict(rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10_000.0,
                                            "factor": 1.0}),
    "ministral3": dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16,
        "max_position_embeddings": 2048, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
        "llama_4_scaling_beta": 0.5}),
}
"""The tiny ERNIE 4.5 with biases on every projection; Seed-OSS with q/k/v biases and none on o (its checkpoints');
Cohere's logits halved; Cohere2's first layer with an 8-token window, the second full and without positions;
Ministral's an 8-token window then a full layer; Ministral 3's YaRN rope and attention temperature from position 16;
StarCoder2's an 8-token window; Hunyuan's fixed-alpha NTK rope."""

_PHI3_SHAPE: dict[str, Any] = dict(original_max_position_embeddings=64, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.2, 1.5, 1.9, 2.4, 3.0], "long_factor": [3.0, 4.0, 6.0, 9.0, 14.0, 20.0],
})
"""The tiny Phi-3 is shaped as Phi-4-mini: rotary on 3/4 of each head (12 of 16 dims), LongRoPE pretrained on 64
positions (short and long factors far apart, so using the wrong set shows), no sliding window unless asked."""

_GRANITE_SHAPE: dict[str, Any] = dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                                      attention_multiplier=0.015625)
"""The tiny Granite: every multiplier far from 1 (the attention scale 1/64 against ``head_dim ** -0.5`` = 1/4),
so dropping any one of them changes the logits; tied embeddings, as every Granite 3.x checkpoint."""

_GPT_OSS_SHAPE: dict[str, Any] = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=2.0,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0,
                                                       "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False})
"""The tiny gpt-oss: 4 experts, 2 per token; a window of 8 (test prompts outrun it) on every other layer; the
SwiGLU clamp at 2 rather than 7 so that it bites at these activations; YaRN as the real models' (factor 32) over
64 original positions. Its sinks, router and expert biases are random like every bias here."""
