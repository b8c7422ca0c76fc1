"""LoRA adapters on an image-text model's decoder, as vLLM serves them: the hooks asyncllm/models/lora.py reads on the
model it serves, answered by the ``language_model``'s.

An adapter names the decoder's projections as the decoder alone names them (``model.layers.N.self_attn.q_proj``:
asyncllm/lora.py maps transformers' ``model.language_model.`` / ``model.text_model.`` and the older
``language_model.model.`` to that); the model's parameters live under ``language_model.``. The tower and projector
take none (an adapter naming them is refused on the host: `AdapterChecker`'s ``runs_tower``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DecoderLoRA"]

_DECODER = "language_model."


class DecoderLoRA:
    """Mixin for a `VisionLanguageModel` whose decoder takes adapters (every image- or audio-text model's but
    Whisper's): its decoder's fused projections, checkpoint names and adapter row hooks."""

    language_model: Any

    @staticmethod
    def normalize_name(name: str) -> str:
        """A name `_packed` is given -> ours: an adapter's decoder name (``model.layers...``) under
        ``language_model.``. A model whose `_packed` reads its checkpoint's names too (a quantized checkpoint's biases:
        asyncllm/models/int4_checkpoint.py) maps them as its loader does (Qwen2-VL's, Qwen2-Audio's)."""
        return _DECODER + name

    @property
    def packed_modules(self) -> dict[str, list[tuple[str, object]]]:
        """The decoder's fused projections (an adapter names their parts)."""
        return self.language_model.packed_modules

    @property
    def fused_parts(self) -> dict[str, list[tuple[object, int]]]:
        """The decoder's fused projections whose adapters come fused too (GLM-4's gate-up: asyncllm/models/lora.py)."""
        return getattr(self.language_model, "fused_parts", {})

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """A name (`normalize_name`'s) -> (our parameter name, shard id or None): the decoder's under
        ``language_model.``, another part's (a tower's) as it is."""
        name = self.normalize_name(ckpt_name)
        if not name.startswith(_DECODER):
            return name, None
        inner, shard_id = self.language_model._packed(name.removeprefix(_DECODER))
        return _DECODER + inner, shard_id

    def lora_b_rows(self, name: str, weight: Any) -> Any:
        """B's rows as the decoder lays out its weight's (Cohere's interleaved rotary pairs reordered)."""
        reorder = getattr(self.language_model, "lora_b_rows", None)
        return weight if reorder is None else reorder(name, weight)

    def lora_also_parts(self, param_name: str, part: object) -> tuple[object, ...]:
        """Other parts the same adapter matrix adapts (Gemma 4's layers whose values are their keys)."""
        also = getattr(self.language_model, "lora_also_parts", None)
        return () if also is None else also(param_name.removeprefix(_DECODER), part)
