"""The supported-models table (docs/models.md), generated from the architecture lists so that it stays true.

``python -m asyncllm.models.catalog > docs/models.md`` writes it; tests/unit/test_catalog.py checks that the file
is what this module generates.
"""

from __future__ import annotations

import pathlib

from asyncllm.models.architectures import (
    AUDIO_ARCHITECTURES, CLASSIFICATION_ARCHITECTURES, EMBEDDING_ARCHITECTURES, HYBRID_ARCHITECTURES,
    LATE_INTERACTION_ARCHITECTURES, MOE_ARCHITECTURES,
    MULTIMODAL_ARCHITECTURES, REWARD_ARCHITECTURES, STATE_SPACE_ARCHITECTURES, SUPPORTED_ARCHITECTURES,
    TEXT_ONLY_CAPABLE_ARCHITECTURES, TOKEN_CLASSIFICATION_ARCHITECTURES, base_architecture,
)

__all__ = ["markdown", "rows"]

_DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
_NOT_MODEL_DOCS = ("architecture.md", "models.md", "benchmarks.md", "configuration.md", "parallelism.md",
                   "lora.md", "quantization.md", "kernels.md", "speculative.md", "security.md")
"""Docs that mention architectures in passing: a model's own doc is looked up in the others first."""
_GENERAL = {"LlamaForCausalLM": "quickstart.md", "MistralForCausalLM": "quickstart.md",
            "Qwen2ForCausalLM": "quickstart.md", "Qwen3ForCausalLM": "quickstart.md"}


def _kind(arch: str) -> str:
    if arch in AUDIO_ARCHITECTURES:
        return "audio-text" + (" (or text only)" if arch in TEXT_ONLY_CAPABLE_ARCHITECTURES else "")
    if arch in MULTIMODAL_ARCHITECTURES and arch in EMBEDDING_ARCHITECTURES:
        return "image-text embedding"  # CLIP
    if arch in MULTIMODAL_ARCHITECTURES:
        experts = ", experts" if arch in MOE_ARCHITECTURES else ""
        return "image-text" + experts + (" (or text only)" if arch in TEXT_ONLY_CAPABLE_ARCHITECTURES else "")
    if arch in LATE_INTERACTION_ARCHITECTURES:
        return "late interaction"  # ColBERT: token embeddings, MaxSim scores
    if arch in EMBEDDING_ARCHITECTURES:
        return "embedding"
    if arch in TOKEN_CLASSIFICATION_ARCHITECTURES:
        return "token classification"
    if arch in CLASSIFICATION_ARCHITECTURES:
        return "classification"
    if arch in REWARD_ARCHITECTURES:
        return "reward"
    if arch in STATE_SPACE_ARCHITECTURES:
        return "state-space (no attention)"
    kind = "hybrid" if arch in HYBRID_ARCHITECTURES else "text"
    return f"{kind}, experts" if arch in MOE_ARCHITECTURES else kind


def _doc(arch: str) -> str:
    """The doc that describes ``arch`` (the first whose text names it in backticks), as a relative link."""
    if arch in _GENERAL:
        return _GENERAL[arch]
    by_kind = {"image-text": "multimodal.md", "audio-text": "multimodal.md", "embedding": "embeddings.md",
               "image-text embedding": "embeddings.md", "classification": "pooling.md",
               "token classification": "pooling.md", "reward": "pooling.md", "late interaction": "pooling.md"}
    kind = _kind(arch).split(" (")[0].removesuffix(", experts")
    if kind in by_kind:
        return by_kind[kind]
    docs = sorted(p for p in _DOCS.glob("*.md") if p.name not in _NOT_MODEL_DOCS)
    docs += [_DOCS / name for name in _NOT_MODEL_DOCS if name not in ("models.md", "architecture.md")]
    for path in docs:
        if f"`{arch}`" in path.read_text(encoding="utf-8"):
            return path.name
    return "architecture.md"


def rows() -> list[tuple[str, str, str, str, str]]:
    """(architecture, kind, pipeline parallel, LoRA, doc) for every supported architecture, sorted by name."""
    from asyncllm.engine.prepare import LORA_MULTIMODAL_ARCHITECTURES, _NO_LORA
    from asyncllm.models.registry import _MODELS
    from asyncllm.pipeline_parallel import PIPELINE_ARCHITECTURES

    out = []
    for arch in sorted(set(SUPPORTED_ARCHITECTURES)):
        multimodal = arch in MULTIMODAL_ARCHITECTURES
        lora = arch in LORA_MULTIMODAL_ARCHITECTURES or not (multimodal or base_architecture(arch) in _NO_LORA)
        as_text = arch in TEXT_ONLY_CAPABLE_ARCHITECTURES and arch not in _NO_LORA
        kind = _kind(arch)
        adaptable = "experts" in kind and getattr(_MODELS.get(arch), "lora_experts", False)
        experts = " (experts too)" if adaptable else ""
        out.append((arch, kind, "yes" if arch in PIPELINE_ARCHITECTURES else "",
                    f"yes{experts}" if lora else f"as text{experts}" if as_text else "", _doc(arch)))
    return out


def markdown() -> str:
    lines = [
        "# Supported models",
        "",
        "Every architecture asyncllm serves (`config.json`'s `architectures[0]`), generated from",
        "`asyncllm/models/architectures.py` by `python -m asyncllm.models.catalog > docs/models.md`",
        "(tests/unit/test_catalog.py keeps the two equal). Any other architecture is refused at once with a",
        "`NotBuiltError` naming it. Every one runs with tensor parallelism, chunked prefill, prefix caching and",
        "preemption, greedy output equal to transformers' (each doc names its tests); pipeline parallelism and",
        "LoRA adapters where marked (text-only LoRA for the image-text models that serve text alone; a mixture of",
        "experts' experts take adapters where marked, its attention always: docs/lora.md).",
        "Pre-quantized checkpoints: docs/quantization.md.",
        "",
        "| Architecture | Kind | Pipeline parallel | LoRA | Docs |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{arch}` | {kind} | {pp} | {lora} | [{doc}]({doc}) |" for arch, kind, pp, lora, doc in rows()]
    return "\n".join(lines + _aliases() + _PARTIAL_ROTARY) + "\n"


def _aliases() -> list[str]:
    """The other spellings asyncllm takes (vLLM's), each with the architecture it serves."""
    from asyncllm.models.architectures import ARCHITECTURE_ALIASES

    spellings = ", ".join(f"`{alias}` (`{ours}`)" for alias, ours in sorted(ARCHITECTURE_ALIASES.items()))
    return ["", f"Other spellings, which vLLM registers too, are served as the architecture named beside them: "
                f"{spellings}."]


_PARTIAL_ROTARY = [
    "",
    "## The rotated fraction of each head (`partial_rotary_factor`)",
    "",
    "Each family rotates what transformers' model for it rotates. Phi, Phi-3, StableLM, GPT-NeoX (`rotary_pct`),",
    "GLM, Nemotron, MiniMax-M2, Qwen3-Next and Qwen3.5 rotate the first `partial_rotary_factor` of each head",
    "(their transformers rotary reads it from `rope_parameters`). Llama, Mistral, Mixtral, Qwen2 / Qwen3 (and",
    "their VL and Omni decoders), Gemma 1-4, Granite, OLMo, Cohere, DeepSeek and the other families in",
    "`asyncllm/models/rope_config.py`'s `WHOLE_HEAD_MODEL_TYPES` rotate the whole head under the default rope",
    "whatever it says (transformers' `compute_default_rope_parameters` for them never reads it; vLLM's Llama would",
    "rotate the fraction): the served config drops such a value, with a warning naming it, and an `hf_overrides`",
    "giving one there is a `ConfigError`. Scaled ropes (YaRN and the rest) and Gemma 4's proportional one read it",
    "in every family, as transformers' `ROPE_INIT_FUNCTIONS` do. GPT-J's rotary dims come from `rotary_dim`.",
]


if __name__ == "__main__":
    print(markdown(), end="")
