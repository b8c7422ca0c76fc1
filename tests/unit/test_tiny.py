"""The tiny local checkpoint: loads with transformers, is deterministic, caches atomically."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import asyncllm.tiny as tiny
from asyncllm.errors import ConfigError
from asyncllm.models.layers import num_kv_heads_of
from asyncllm.tiny import SPECIAL_TOKENS, TINY_ARCHS, make_tiny_checkpoint, tiny_cache_dir, tiny_checkpoint

MULTIBYTE = "héllo wörld ✓ 日本語 🙂"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_arch_loads_with_transformers(arch: str) -> None:
    import transformers

    path = tiny_checkpoint(arch)  # the cached build the other tests use (built here when first asked for)
    auto = transformers.Mistral4ForCausalLM if arch == "mistral4" else AutoModelForCausalLM  # not an Auto class's
    model = auto.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    assert model.config.model_type == {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text",
                                       "qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text",
                                       "gemma4": "gemma4_text", "gemma4_moe": "gemma4_text",
                                       "gemma3n": "gemma3n_text"}.get(arch, arch)
    assert model.config.vocab_size == len(tokenizer) == 512
    assert model.get_input_embeddings().weight.shape == (512, 64)
    four = ("nemotron_h", "gemma4", "gemma3n")  # Nemotron-H: 4 one-mixer layers; Gemma 4 / 3n: two sharing the others' KV
    four += ("longcat_flash",)  # LongCat-Flash: 2 layers of 2 attention blocks (num_hidden_layers counts the blocks)
    # Zamba2: 2 Mamba2 layers and 3 hybrid ones (two shared blocks, one of them invoked twice); Kimi-Linear: KDA
    # (dense MLP), latent attention (experts), KDA (experts)
    layers = 4 if arch in four else 5 if arch == "zamba2" else 3 if arch == "kimi_linear" else 2
    assert model.config.num_hidden_layers == layers
    latent = arch.startswith("deepseek") or arch in ("glm4_moe_lite", "mistral4", "youtu", "minicpm3", "kimi_linear",
                                                                 "glm_moe_dsa", "longcat_flash")
    kv_heads = (model.config.per_layer_config[0].num_key_value_heads if arch.startswith("gemma4")  # per layer
                else 1 if arch == "gpt_bigcode" and model.config.multi_query  # multi-query attention
                else model.config.num_kv_heads if arch == "falcon"  # its own name
                else num_kv_heads_of(model.config))  # GPT-2, OPT, GPT-J, GPT-NeoX: one per head, named nowhere
    multi_head = arch in ("gpt_neox", "gpt2", "opt", "gptj", "bloom", "mpt")
    assert kv_heads == (4 if latent or multi_head else 1 if arch == "gpt_bigcode" else 2)  # latent: one per head
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4, 5]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == 1
    assert model.get_input_embeddings().weight.dtype == torch.float32

    hi = tokenizer("Hi", add_special_tokens=False).input_ids
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    assert rendered == [0, 3, *hi, 1, 4]

    ids = tokenizer(MULTIBYTE).input_ids
    assert ids[0] == 0
    assert tokenizer.decode(ids, skip_special_tokens=True) == MULTIBYTE
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)
    assert torch.isfinite(logits).all()


def test_tokenizers_are_identical_across_archs(tmp_path: Path) -> None:
    """transformers picks Qwen2Tokenizer for qwen2: it must encode exactly like the others."""
    texts = [MULTIBYTE, "def f(x):\n    return x  +  12345\n\n", "  a    b ", "<|user|>hi<|eos|>"]
    encodings = {}
    for arch in ("llama", "qwen2"):
        tokenizer = AutoTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path / arch, arch))
        encodings[arch] = ([tokenizer(t).input_ids for t in texts], len(tokenizer), tokenizer.all_special_ids)
    assert encodings["llama"] == encodings["qwen2"]


def test_multibyte_text_round_trips(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_checkpoint(tmp_path, "llama"))
    for text in (MULTIBYTE, "Привет мир ¿qué? «ñ» — 中文 한국어 🙂🙂\n\t", "\u00e9\u20ac\U0001f680"):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < 512 for i in ids)


def test_same_seed_gives_same_checkpoint_and_other_seed_differs(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", "qwen3", seed=0)
    b = make_tiny_checkpoint(tmp_path / "b", "qwen3", seed=0)
    c = make_tiny_checkpoint(tmp_path / "c", "qwen3", seed=1)
    wa, wb, wc = (load_file(str(Path(p) / "model.safetensors")) for p in (a, b, c))
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert (Path(a) / "tokenizer.json").read_bytes() == (Path(b) / "tokenizer.json").read_bytes()


def test_norm_weights_and_biases_are_random(tmp_path: Path) -> None:
    """A loader that drops a norm weight or a bias must change the outputs."""
    weights = load_file(str(Path(make_tiny_checkpoint(tmp_path, "qwen2")) / "model.safetensors"))
    norm = weights["model.layers.0.input_layernorm.weight"]
    bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert not torch.equal(norm, torch.ones_like(norm))
    assert 0.5 < norm.mean().item() < 1.5
    assert bias.abs().max().item() > 0.0


def test_shape_options_and_overrides(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(
        tmp_path, "llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, vocab_size=300,
    )
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.vocab_size) == (32, 1, 16, 300)
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert len(AutoTokenizer.from_pretrained(path)) == 300
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_mistral_has_full_attention_and_generation_config(tmp_path: Path) -> None:
    path = Path(make_tiny_checkpoint(tmp_path, "mistral"))
    assert AutoConfig.from_pretrained(path).sliding_window is None
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"]) == (1, 0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"arch": "gpt3"}, "arch"), ({"vocab_size": 100}, "vocab_size"), ({"num_heads": 3}, "num_heads")],
)
def test_bad_arguments_raise_config_error(kwargs: dict, field: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        make_tiny_checkpoint(tmp_path, **kwargs)
    assert info.value.field == field


def test_cached_builder_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = tiny_checkpoint("llama", hidden_size=32)
    assert Path(first).parent == tiny_cache_dir() == tmp_path / "asyncllm" / "tiny"
    assert Path(first).name.startswith("llama-")

    def fail(*args: object, **kwargs: object) -> str:
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(tiny, "make_tiny_checkpoint", fail)
    assert tiny_checkpoint("llama", hidden_size=32) == first
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_checkpoint("llama", hidden_size=48)
    assert sorted(p.name for p in tiny_cache_dir().iterdir()) == [Path(first).name]


def test_concurrent_builders_end_with_one_complete_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both racers build; one rename wins, the loser cleans up and returns the winner's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    barrier = threading.Barrier(2)
    real_build = tiny.make_tiny_checkpoint

    def build_in_lockstep(*args: object, **kwargs: object) -> str:
        result = real_build(*args, **kwargs)  # type: ignore[arg-type]
        barrier.wait(timeout=60)
        return result

    monkeypatch.setattr(tiny, "make_tiny_checkpoint", build_in_lockstep)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(tiny_checkpoint("qwen2"))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in tiny_cache_dir().iterdir()] == [Path(results[0]).name]
    assert AutoTokenizer.from_pretrained(results[0]).eos_token_id == 1
