"""Draft-model speculation on the host and in the core (the workers' half: workers/draft_runner.py).

`prepare_draft_model` runs in the host's preparation, before anything is
spawned: it finds the draft checkpoint, refuses a draft whose vocabulary
differs from the target's (naming both sizes), an architecture that is not
built, and a draft tensor-parallel size other than the target's, and
resolves the draft's ``model`` to a folder and its ``max_model_len``.

`DraftModelProposer` is the scheduler's side: the workers return each step's
drafts with its output (`ModelRunnerOutput.draft_token_ids`, proposed after
the step's tokens were verified), and the next step takes them as its drafts
under the same budget and KV rules as n-gram drafts (docs/speculative.md).
Only the last step's drafts are kept, so nothing outlives its request.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.spec.config import SPEC_FIELD, SpeculativeConfig

__all__ = ["DraftModelProposer", "prepare_draft_model"]


class DraftModelProposer:
    """The drafts the workers proposed in the last step, by request id."""

    def __init__(self) -> None:
        self.drafts: dict[str, list[int]] = {}

    def update(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Take one step's drafts (replacing the last step's: they were for tokens now known)."""
        self.drafts = draft_token_ids

    def take(self, req_id: str, max_drafts: int) -> list[int]:
        """The request's drafts for its next step, at most ``max_drafts`` of them."""
        drafts = self.drafts.pop(req_id, None)
        if not drafts or max_drafts <= 0:
            return []
        return drafts[:max_drafts]


def prepare_draft_model(spec_dict: dict, spec: SpeculativeConfig, target_config: Any, tensor_parallel_size: int,
                        max_model_len: int, multimodal: bool, arch: str | None = None,
                        download_dir: str | None = None, load_format: str = "auto") -> dict:
    """Check the draft checkpoint against the target (``target_config``: its text config; ``arch``: the
    checkpoint's architecture, default the config's; ``download_dir``: the engine's hub cache; ``load_format``: the
    engine's, which the draft is loaded with: a hub id's files fetched as for the target, none of its weights for
    'dummy'); returns ``speculative_config`` with the draft's folder."""
    from asyncllm.models.architectures import HYBRID_ARCHITECTURES, TEXT_ARCHITECTURES, architecture_of, max_positions
    from asyncllm.models.checkpoint import load_hf_config, resolve_model_path
    from asyncllm.models.eagle_targets import check_multimodal_target

    if multimodal:  # EAGLE heads for the M-RoPE families (asyncllm/models/eagle_targets.py); no other draft
        check_multimodal_target(spec_dict, spec.method, target_config, arch)
    if spec.method == "mtp":
        _check_mtp_target(spec_dict, target_config, arch or architecture_of(target_config))
        return {"method": "mtp", "num_speculative_tokens": spec.num_speculative_tokens}
    draft_tp = spec.draft_tensor_parallel_size
    if draft_tp is not None and draft_tp not in (tensor_parallel_size, 1):
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"draft_tensor_parallel_size={draft_tp} other than 1 or the target's "
                                                   f"tensor_parallel_size={tensor_parallel_size}")
    if draft_tp == 1 and tensor_parallel_size > 1 and spec.method != "draft_model":
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"draft_tensor_parallel_size=1 for an {spec.method} head (it reads "
                                                   "the target's sharded embeddings and hidden states: the target's size)")
    from asyncllm.models.eagle import load_head_config, speculators_kind

    path = resolve_model_path(spec.model, spec.revision, download_dir,  # type: ignore[arg-type]
                              load_format=load_format)
    method = spec.method
    if method == "draft_model" and "method" not in spec_dict and speculators_kind(path) == "eagle3":
        method = "eagle3"  # vLLM reads the method from the head
    draft_config = load_head_config(path) if method != "draft_model" else load_hf_config(path)
    if method != "draft_model":
        _check_eagle_head(spec_dict, method, draft_config, target_config, arch or architecture_of(target_config))
    elif (arch := architecture_of(draft_config)) not in TEXT_ARCHITECTURES:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"a {arch} draft model (text decoders only: "
                                                   f"{', '.join(TEXT_ARCHITECTURES)})")
    elif arch in HYBRID_ARCHITECTURES:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"a {arch} draft model (its recurrent states would run ahead over "
                                                   "drafts; attention-only drafts)")
    draft_vocab, target_vocab = draft_config.vocab_size, target_config.vocab_size
    if draft_vocab != target_vocab:
        raise ConfigError(SPEC_FIELD, spec_dict, f"a draft model with the target's vocabulary: the draft {spec.model} has "
                                                 f"vocab_size={draft_vocab}, the target {target_vocab}")
    limit = max_positions(draft_config) or max_model_len
    draft_len = min(max_model_len, limit) if spec.max_model_len is None else spec.max_model_len
    if draft_len > limit:
        raise ConfigError(SPEC_FIELD, spec_dict, f"max_model_len at most the draft's max_position_embeddings (times its "
                                                 f"rope scaling factor: {limit})")
    return {**spec_dict, "method": method, "model": path, "revision": None, "max_model_len": draft_len}


def _check_eagle_head(spec_dict: dict, method: str, head_config: Any, target_config: Any, target_arch: str) -> None:
    """An EAGLE head that fits the target: a Llama-shaped head of the method's kind, the target's hidden size, not a
    hybrid target; for EAGLE-3 layers the target has, in a decoder that keeps their inputs (one whose layer loop is
    `LlamaModel`'s: mixtures of experts too, Qwen3-MoE's and gpt-oss's among them)."""
    from asyncllm.models.architectures import HYBRID_ARCHITECTURES
    from asyncllm.models.eagle import EAGLE3_ARCHITECTURES, eagle3_aux_layers
    from asyncllm.models.eagle_targets import MROPE_EAGLE_ARCHITECTURES, language_model_class
    from asyncllm.models.llama import LlamaModel

    if target_arch in HYBRID_ARCHITECTURES:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"an {method} head for a {target_arch} target (hybrids draft with "
                                                   "n-grams, a draft model or their own MTP layer: method='mtp')")

    arch = (getattr(head_config, "architectures", None) or ["?"])[0]
    model_type = getattr(head_config, "model_type", None)
    if model_type != "llama":  # vLLM's EagleLlama4ForCausalLM, Llama 4 layers: a head kind asyncllm lacks
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"an {method} head of architecture {arch} (model_type={model_type!r}; "
                                                   "built: Llama-shaped heads, model_type='llama')")
    if (arch in EAGLE3_ARCHITECTURES) != (method == "eagle3"):
        want = "LlamaForCausalLMEagle3" if method == "eagle3" else "LlamaForCausalLM"
        raise ConfigError(SPEC_FIELD, spec_dict, f"a Llama-shaped {method} head (config.json naming {want}); "
                                                 f"{spec_dict.get('model')} names {arch}")
    hidden = getattr(head_config, "target_hidden_size", None) or head_config.hidden_size
    if hidden != target_config.hidden_size or (method == "eagle" and head_config.hidden_size != hidden):
        raise ConfigError(SPEC_FIELD, spec_dict, f"a head for the target's hidden_size={target_config.hidden_size} "
                                                 f"(it reads {hidden})")
    if method == "eagle":
        return
    eagle_config = getattr(head_config, "eagle_config", None) or {}
    built = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
             "use_mtp_layernorm": False}  # ModelOpt's flags: EAGLE-3's own layout is the one built
    other = {key: eagle_config[key] for key, value in built.items() if eagle_config.get(key, value) != value}
    if other:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"an EAGLE-3 head with eagle_config {other} (built: {built})")
    num_layers = target_config.num_hidden_layers
    layers = eagle3_aux_layers(head_config, num_layers)
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ConfigError(SPEC_FIELD, spec_dict, f"three target layers in [0, {num_layers}) for an EAGLE-3 head to "
                                             f"read; it names {list(layers)}")
    if target_arch in MROPE_EAGLE_ARCHITECTURES:  # their decoders keep the layers' inputs too
        return
    language_model = language_model_class(target_config, target_arch)  # Llama's stack and token embeddings
    decoder_cls = getattr(language_model, "model_cls", None)
    if (getattr(decoder_cls, "forward", None), getattr(decoder_cls, "embed", None)) != (LlamaModel.forward,
                                                                                          LlamaModel.embed):
        name = getattr(language_model, "__name__", target_config.model_type)
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"an EAGLE-3 head for a {target_arch} target ({name}; Llama-style "
                                                   "decoders: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, "
                                                   "DeepSeek, Llama 4, ...)")


def _check_mtp_target(spec_dict: dict, target_config: Any, arch: str) -> None:
    """A target whose checkpoint has a multi-token-prediction layer asyncllm reads."""
    from asyncllm.models.mtp import MTP_ARCHITECTURES, num_mtp_layers

    if arch not in MTP_ARCHITECTURES:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"multi-token prediction for {arch} (built for "
                                                   f"{', '.join(MTP_ARCHITECTURES)})")
    layers = num_mtp_layers(target_config)
    if not layers:
        raise ConfigError(SPEC_FIELD, spec_dict, "a target with multi-token-prediction layers (its config.json has "
                                                 "num_nextn_predict_layers / mtp_num_hidden_layers 0 or none)")
    if layers > 1:
        raise NotBuiltError(SPEC_FIELD, spec_dict, f"{layers} MTP layers (one MTP layer, drafting again from its own "
                                                   "output)")
    if getattr(target_config, "mtp_use_dedicated_embeddings", False):
        raise NotBuiltError(SPEC_FIELD, spec_dict, "an MTP layer with its own embeddings (mtp_use_dedicated_embeddings: "
                                                   "it reads the target's)")
