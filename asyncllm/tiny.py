"""A tiny random-weight model that asyncllm builds locally, without any download.

The README's main command, the examples and the engine tests need a real
Hugging Face checkpoint (config, safetensors weights, tokenizer, chat template,
generation config) that loads with both transformers and asyncllm. This module
makes one in about a second: a byte-level BPE tokenizer trained on a fixed
slice of the Python standard library's own source (so it needs no data set and
round-trips any Unicode text), and a Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 /
Gemma 3 / Phi-3 / Granite / OLMo 2 model (or a mixture of experts: Mixtral, Qwen-MoE, gpt-oss) with seeded random
weights.

The weights are drawn wider than transformers' default initialisation, and the
norm weights and biases are random too, so that logits are far from uniform
(greedy outputs do not hinge on rounding noise) and a loader that drops a norm
weight or a bias produces different tokens instead of passing unnoticed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.tiny_shapes import (  # each family's layer mix
    _BIAS_SHAPES, _DEEPSEEK_SHAPES, _EXAONE4_SHAPE, _GEMMA_SHAPES, _GPT_OSS_SHAPE, _GRANITE_SHAPE, _LAYER_SHAPES,
    _MOE_SHAPES, _OLMO3_SHAPE, _PHI3_SHAPE, _SMOLLM3_SHAPE,
)

__all__ = ["TINY_ARCHS", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "make_tiny_checkpoint", "tiny_checkpoint", "tiny_cache_dir"]

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3", "phi3",
              "granite", "olmo2", "olmo3", "smollm3", "exaone4", "glm", "glm4", "ernie4_5", "seed_oss", "arcee",
              "cohere", "cohere2", "ministral", "ministral3", "granitemoe", "olmoe", "starcoder2",
              "hunyuan_v1_dense", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_5",
              "qwen3_5_moe", "qwen3_next", "minimax_m2", "granitemoehybrid",
              "lfm2", "lfm2_moe", "nemotron_h", "bamba", "ernie4_5_moe", "hunyuan_v1_moe",
              "dots1", "llama4", "glm4_moe_lite", "falcon_h1", "apertus", "jamba", "mistral4", "solar_open",
              "sarvam_moe", "gemma", "gemma4", "gemma4_moe", "exaone_moe", "helium", "vaultgemma",
              "granitemoeshared", "flex_olmo", "phi", "stablelm", "nemotron", "gpt_neox", "gpt2", "gpt_bigcode", "opt", "gptj",
              "falcon", "olmo", "jais2", "cwm", "youtu", "gemma3n", "phimoe", "minicpm3", "dbrx", "longcat_flash",
              "zamba2", "kimi_linear", "bloom", "mpt", "deepseek_v32", "glm_moe_dsa", "minimax", "afmoe")
"""The architectures `make_tiny_checkpoint` can build (mixtral, the *_moe ones, granitemoe, olmoe, gpt_oss and the
deepseek ones are mixtures of experts)."""

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>")
"""Special tokens of the tiny tokenizer; their ids are 0..5 in this order."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments within '"
    "'<tool_call></tool_call>:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n"
    "</tool_call>' + eos_token }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>\\n' + message['content'] + '\\n</tool_response>' + eos_token }}"
    "{% elif message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' + (function['arguments'] | tojson)"
    " + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Jinja chat template of the tiny tokenizer: ``<|bos|><|user|>Hi<|eos|><|assistant|>``.

With ``tools`` it also writes them into a system turn, and an assistant's
``tool_calls`` as Hermes ``<tool_call>`` blocks (the ``hermes`` tool parser
reads them back); a ``tool`` message is a user turn in ``<tool_response>``.
Without tools and tool messages it renders as it always did.
"""

_FORMAT_VERSION = 2
"""Bump when the checkpoint layout or the recipe changes, so cached builds are rebuilt."""

_CORPUS_FILES = (
    "argparse.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "enum.py", "functools.py",
    "json/decoder.py", "json/encoder.py", "pathlib.py", "shlex.py", "string.py", "textwrap.py",
)
"""Standard-library sources the tokenizer is trained on (about 500 KB; missing ones are skipped)."""

_CORPUS_EXTRA = "héllo wörld ✓ 日本語 🙂 ¿qué? naïve café — «ñ» Ω≈ç√ 中文 한국어 Привет мир"
"""A little non-ASCII text so some multi-byte characters get merges of their own."""

_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenizer split (GPT-4 style, one digit per token)."""

_INIT_STD = 0.2
"""Weight std: 10x transformers' 0.02, so logits spread out (median top-2 gap ~0.4) and attention is not uniform."""


def make_tiny_checkpoint(
    path: str | os.PathLike[str],
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    **config_overrides: Any,
) -> str:
    """Write a tiny random model, its tokenizer and generation config to ``path``; return the path.

    ``tie_word_embeddings`` None is the family's usual: tied for Gemma and Granite (as their checkpoints), untied
    for the others.

    ``config_overrides`` are passed to the transformers config class as is
    (e.g. ``rope_parameters``, ``sliding_window``, ``rms_norm_eps``).
    """
    if arch not in TINY_ARCHS:
        raise ConfigError("arch", arch, f"one of {', '.join(TINY_ARCHS)}")
    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        raise ConfigError("vocab_size", vocab_size, f">= {len(SPECIAL_TOKENS) + 257} (256 bytes, specials, merges)")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ConfigError("num_heads", num_heads, "must divide hidden_size and be a multiple of num_kv_heads")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size, max_position_embeddings)
    tokenizer.save_pretrained(out)
    _pin_no_unk_token(out / "tokenizer_config.json")
    config = _build_config(
        arch, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
        dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
             num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
             max_position_embeddings=max_position_embeddings,
             tie_word_embeddings=_tied(arch) if tie_word_embeddings is None else tie_word_embeddings),
        config_overrides,
    )
    _build_model(config, seed).save_pretrained(out, safe_serialization=True)
    return str(out)


def _tied(arch: str) -> bool:
    """Whether the family's checkpoints tie the LM head to the embeddings: every Gemma's and Granite 3.x's."""
    return arch in (*_GEMMA_SHAPES, "gemma4", "gemma4_moe", "gemma3n", "granite", "granitemoe", "granitemoeshared", "gpt2", "gpt_bigcode",
                    "opt", "falcon", "minicpm3", "zamba2", "bloom", "mpt")


def tiny_cache_dir() -> Path:
    """Folder that holds cached tiny checkpoints (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``asyncllm/tiny``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "asyncllm" / "tiny"


def tiny_checkpoint(arch: str = "llama", **kwargs: Any) -> str:
    """Return the folder of a cached tiny checkpoint, building it once.

    The folder name hashes the arguments and the versions that shape the
    result, so a change of recipe never reuses a stale build. The build goes
    to a temporary sibling folder that is renamed into place, so processes
    racing to build the same checkpoint all end up with one complete folder.
    """
    final = tiny_cache_dir() / f"{arch}-{_build_key(arch, kwargs)}"
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent)
    try:
        make_tiny_checkpoint(staging, arch, **kwargs)
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(final)


def _build_key(arch: str, kwargs: dict[str, Any]) -> str:
    import tokenizers
    import torch
    import transformers

    from asyncllm import __version__

    recipe = {
        "arch": arch, "kwargs": kwargs, "format": _FORMAT_VERSION, "asyncllm": __version__,
        "python": sys.version_info[:2], "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "recipes": hashlib.sha256(Path(__file__).read_bytes() + (Path(__file__).parent / "tiny_shapes.py")
                                  .read_bytes()).hexdigest(),  # the recipes or shapes edited: rebuilt
    }
    blob = json.dumps(recipe, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS_FILES if (stdlib / name).is_file()]
    return [*texts, _CORPUS_EXTRA]


_TRAINED: dict[int, str] = {}
"""vocab size -> the trained BPE on the default corpus (its JSON): deterministic, so a process trains it once."""


def _build_tokenizer(vocab_size: int, model_max_length: int, corpus: list[str] | None = None) -> Any:
    """Train the byte-level BPE (on ``corpus``, default the fixed stdlib slice) and wrap it as a
    transformers fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if corpus is None and vocab_size in _TRAINED:
        backend = Tokenizer.from_str(_TRAINED[vocab_size])
    else:
        backend = _train_backend(vocab_size, corpus)
        if corpus is None:
            _TRAINED[vocab_size] = backend.to_str()
    bos = SPECIAL_TOKENS[0]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=SPECIAL_TOKENS[1], pad_token=SPECIAL_TOKENS[2],
        clean_up_tokenization_spaces=False, model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _train_backend(vocab_size: int, corpus: list[str] | None) -> Any:
    """The byte-level BPE trained on ``corpus`` (default the fixed stdlib slice), with its BOS post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    # Qwen2's exact pipeline: transformers rebuilds it for model_type "qwen2" whatever the file
    # says, so using it for every arch keeps all four tiny tokenizers identical.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(_corpus() if corpus is None else corpus, trainer)
    bos = SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))],
    )
    return backend


def _pin_no_unk_token(tokenizer_config: Path) -> None:
    """Write ``"unk_token": null`` so that transformers' Qwen2Tokenizer (which it picks for
    model_type "qwen2") does not add its default ``<|endoftext|>`` and grow the vocabulary."""
    fields = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    fields["unk_token"] = None
    tokenizer_config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build_config(
    arch: str, vocab_size: int, bos: int, eos: int, pad: int, shape: dict[str, Any], overrides: dict[str, Any],
) -> Any:
    import transformers

    config_cls = getattr(transformers, {  # by name: a transformers without one of them still builds the rest
        "llama": "LlamaConfig", "mistral": "MistralConfig",
        "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
        "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
        "qwen3_moe": "Qwen3MoeConfig", "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config",
        "granite": "GraniteConfig", "olmo2": "Olmo2Config",
        "olmo3": "Olmo3Config", "smollm3": "SmolLM3Config",
        "exaone4": "Exaone4Config", "glm": "GlmConfig", "glm4": "Glm4Config",
        "ernie4_5": "Ernie4_5Config", "seed_oss": "SeedOssConfig",
        "arcee": "ArceeConfig", "cohere": "CohereConfig",
        "cohere2": "Cohere2Config", "ministral": "MinistralConfig",
        "ministral3": "Ministral3Config", "granitemoe": "GraniteMoeConfig",
        "olmoe": "OlmoeConfig", "starcoder2": "Starcoder2Config",
        "hunyuan_v1_dense": "HunYuanDenseV1Config", "minicpm3": "MiniCPM3Config",
        "gpt_oss": "GptOssConfig", "deepseek_v2": "DeepseekV2Config",
        "deepseek_v3": "DeepseekV3Config", "glm4_moe": "Glm4MoeConfig",
        "qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig",
        "qwen3_next": "Qwen3NextConfig", "minimax_m2": "MiniMaxM2Config",
        "granitemoehybrid": "GraniteMoeHybridConfig", "lfm2": "Lfm2Config", "lfm2_moe": "Lfm2MoeConfig",
        "nemotron_h": "NemotronHConfig", "bamba": "BambaConfig",
        "ernie4_5_moe": "Ernie4_5_MoeConfig", "hunyuan_v1_moe": "HunYuanMoEV1Config",
        "dots1": "Dots1Config", "llama4": "Llama4TextConfig",
        "glm4_moe_lite": "Glm4MoeLiteConfig", "falcon_h1": "FalconH1Config",
        "apertus": "ApertusConfig", "jamba": "JambaConfig",
        "mistral4": "Mistral4Config", "solar_open": "SolarOpenConfig",
        "sarvam_moe": "SarvamMoEConfig", "gemma": "GemmaConfig",
        "gemma4": "Gemma4TextConfig", "gemma3n": "Gemma3nTextConfig", "gemma4_moe": "Gemma4TextConfig",
        "exaone_moe": "ExaoneMoeConfig", "helium": "HeliumConfig",
        "vaultgemma": "VaultGemmaConfig", "granitemoeshared": "GraniteMoeSharedConfig",
        "flex_olmo": "FlexOlmoConfig", "phi": "PhiConfig",
        "stablelm": "StableLmConfig", "nemotron": "NemotronConfig",
        "gpt_neox": "GPTNeoXConfig", "gpt2": "GPT2Config",
        "gpt_bigcode": "GPTBigCodeConfig", "opt": "OPTConfig", "gptj": "GPTJConfig",
        "falcon": "FalconConfig", "olmo": "OlmoConfig", "jais2": "Jais2Config",
        "cwm": "CwmConfig", "youtu": "YoutuConfig", "phimoe": "PhimoeConfig",
        "dbrx": "DbrxConfig", "zamba2": "Zamba2Config",
        "kimi_linear": "KimiLinearConfig", "bloom": "BloomConfig", "longcat_flash": "LongcatFlashConfig",
        "mpt": "MptConfig", "deepseek_v32": "DeepseekV32Config",
        "glm_moe_dsa": "GlmMoeDsaConfig", "minimax": "MiniMaxConfig", "afmoe": "AfmoeConfig",
    }[arch])
    fields: dict[str, Any] = dict(
        shape, vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        initializer_range=_INIT_STD, dtype="float32",
    )
    if arch not in ("qwen2", "qwen2_moe", "phi3", "falcon", *_DEEPSEEK_SHAPES):  # qwen2*: head_dim defaults to
        # 128; phi3 none; falcon's is a property
        fields["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    if arch in _DEEPSEEK_SHAPES:  # every head has its own key and value (from the latent)
        fields.update(copy.deepcopy(_DEEPSEEK_SHAPES[arch]), num_key_value_heads=shape["num_attention_heads"])
    if arch in ("mistral", "mixtral"):
        fields["sliding_window"] = None  # full attention unless asked for
    if arch == "falcon":  # its own name for the KV heads
        fields["num_kv_heads"] = shape["num_key_value_heads"]
    fields.update(_MOE_SHAPES.get(arch, {}))
    if arch == "phi3":
        fields.update(copy.deepcopy(_PHI3_SHAPE))
    if arch in ("granite", "granitemoe", "granitemoehybrid", "granitemoeshared"):
        fields.update(_GRANITE_SHAPE)
    fields.update(copy.deepcopy(_LAYER_SHAPES.get(arch, {})))
    if arch in ("gemma4", "gemma4_moe"):
        fields["vocab_size_per_layer_input"] = vocab_size
    if arch == "gpt_oss":
        fields.update(copy.deepcopy(_GPT_OSS_SHAPE))
    if arch == "olmo3":
        fields.update(copy.deepcopy(_OLMO3_SHAPE), layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape["num_hidden_layers"])])
    if arch == "smollm3":
        fields.update(_SMOLLM3_SHAPE)
    if arch == "exaone4":
        fields.update(_EXAONE4_SHAPE)
    fields.update(_BIAS_SHAPES.get(arch, {}))
    if arch in _GEMMA_SHAPES:
        fields.update(copy.deepcopy(_GEMMA_SHAPES[arch]), layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape["num_hidden_layers"])])
    fields.update(overrides)
    if arch == "dbrx":  # its own names, read before the aliases (the experts' size); the KV heads: attn_config's
        fields.update({name: fields.pop(alias) for alias, name in config_cls.attribute_map.items()})
        del fields["num_key_value_heads"]
    if arch in ("bloom", "mpt"):  # ALiBi: no KV heads, MLP width or position table of their own (MPT: max_seq_len)
        for name in ("num_key_value_heads", "intermediate_size", "head_dim"):
            fields.pop(name, None)
        limit = fields.pop("max_position_embeddings")
        if arch == "mpt":
            fields["max_seq_len"] = limit
    return config_cls(**fields)


def _build_model(config: Any, seed: int) -> Any:
    """Seeded random weights; 1-D parameters (norm weights, biases, gpt-oss's sinks) and gpt-oss's stacked expert
    biases randomised as well."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import transformers

    torch.manual_seed(seed)
    if type(config).__name__ == "Mistral4Config":  # not registered with AutoModelForCausalLM (its releases are
        model = transformers.Mistral4ForCausalLM(config).to(torch.float32)  # Mistral 3 image-text checkpoints)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 or name.endswith(("_proj_bias", "e_score_correction_bias", "q_norm.weight",
                                                 "k_norm.weight", "forget_gate.A_log", "router.gate.weight")):
                # Command R+'s per-head norms are 2-D; Kimi-Linear's A_log [1, 1, H, 1] (FLA's init decays by up to
                # e^-16 a token); AFMoE's router (zeros at init: every token would score the experts alike)
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=_INIT_STD)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # routing corrections (zeros at init)
                buffer.normal_(std=_INIT_STD)
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (ones at init)
                buffer.normal_(mean=1.0, std=_INIT_STD)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    return model
