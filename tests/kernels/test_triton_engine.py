"""The whole engine on the triton backend (interpreted on a CPU): greedy tokens equal transformers' for Llama.
Qwen3 (its per-head q/k RMSNorm fused into the rotary/KV-write kernel), Mistral and the fused_moe kernel run
model-level in test_triton_backend.py (an engine start and its interpreted steps cost seconds more than the model)."""

from __future__ import annotations

import asyncio

from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams

MAX_TOKENS = 4
PROMPTS = [[7, 99, 23, 5, 411, 62, 9, 300, 18], [45, 12, 230, 77, 3, 150, 89, 64, 33, 21, 8, 402, 17, 260, 95]]


async def test_triton_engine_greedy_parity(tiny_llama: str, monkeypatch) -> None:
    """The engine's step (chunks over cached context beside decodes) through the Triton kernels; each architecture's
    own layers under Triton (Qwen3's q/k norms, ...) are held to transformers' logits in test_triton_backend.py, the
    fused decode products (interpreted, four fifths of this test's time) model-level there too (Granite)."""
    monkeypatch.setenv("ASYNCLLM_DECODE_LINEAR", "0")  # the workers take the host's environment
    path = tiny_llama
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    async with AsyncEngine(
        path, attention_backend="triton", dtype="float32", max_num_batched_tokens=16, block_size=8,
        num_gpu_blocks_override=256, kv_cache_memory_bytes=1 << 28, disable_log_stats=True,  # no profile: tests share a GPU
    ) as engine:  # 16-token steps: the longer prompt is chunked over cached context while the other decodes
        outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS)


async def test_triton_engine_whisper_cross_attention(tmp_path) -> None:
    """Whisper's cross-attention over its per-row states (asyncllm/models/whisper.py) through both Triton kernels:
    the unified one for prompt chunks (every encoder row visible: ``attend_limit``; the prompt's log-probabilities
    within 1e-4 of transformers'), the split-KV one for decodes (greedy tokens equal)."""
    from audio_utils import SAMPLING_RATE, make_audio
    from transformers import AutoTokenizer
    from whisper_utils import PROMPT, hf_whisper_greedy, hf_whisper_prompt_logprobs, make_tiny_whisper

    path = make_tiny_whisper(tmp_path / "whisper")
    prompts = [PROMPT + " hello there" * 4]  # chunked over 8-token steps, then decodes
    audios = [make_audio(3.0, seed=2)]  # no silent padding: every encoder row counts
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0)
    async with AsyncEngine(path, attention_backend="triton", dtype="float32", max_num_batched_tokens=8,
                           kv_cache_memory_bytes=1 << 28, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate({"prompt": p, "multi_modal_data": {"audio": (a, SAMPLING_RATE)}},
                                                      params) for p, a in zip(prompts, audios)))
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt, audio, out in zip(prompts, audios, outs):
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        assert out.token_ids == hf_whisper_greedy(path, audio, ids, MAX_TOKENS)
        got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
        assert max(abs(a - b) for a, b in zip(got, hf_whisper_prompt_logprobs(path, audio, ids))) < 1e-4
