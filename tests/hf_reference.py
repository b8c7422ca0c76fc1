"""transformers' outputs, the reference every engine test compares against."""

from __future__ import annotations

import functools
import os
from importlib.metadata import version

from packaging.version import Version

HF_AYA_VISION_SCALES_LOGITS = Version(version("transformers")) >= Version("5.25")
"""transformers 5.25 and later scale Aya Vision's Cohere logits by ``logit_scale`` themselves, as asyncllm and vLLM do."""

@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):  # a GGUF file: transformers dequantizes it
        folder, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return _causal_lm(path).eval()


def _causal_lm(path: str):
    """transformers' causal LM of the checkpoint: the Auto class's, or (Mistral 4, which it does not register)
    the class its config.json names."""
    import json

    import torch
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    arch = (config.get("architectures") or [""])[0]
    cls = getattr(transformers, arch) if arch == "Mistral4ForCausalLM" else transformers.AutoModelForCausalLM
    kwargs = {}
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        # the dequantized reference: transformers >= 5.25 keeps MXFP4 on CPU when `kernels` is installed and fetches
        # its triton kernels from the Hub (5.24 dequantized on CPU unasked)
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = cls.from_pretrained(path, dtype=torch.float32, **kwargs)
    if arch == "NemotronHForCausalLM":  # transformers < 5.25 clamped prefill dt below at time_step_min (an init
        for module in model.modules():  # range); 5.25 and vLLM clamp to time_step_limit
            if hasattr(module, "time_step_limit"):
                module.time_step_limit = tuple(model.config.time_step_limit)
    return model


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """transformers' greedy `generate` for one prompt (no padding involved); `generate_kwargs` go to `generate`."""
    return model_greedy(_hf_model(path), prompt_ids, max_new_tokens, **generate_kwargs)


def model_greedy(model, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """`hf_greedy` for a transformers model already built (e.g. holding a test's own weights)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **generate_kwargs,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_embeds_greedy(path: str, embeds, max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` from a prompt given as embeddings ``[tokens, hidden]`` (``inputs_embeds``)."""
    import torch

    with torch.no_grad():
        out = _hf_model(path).generate(inputs_embeds=embeds[None].float(), max_new_tokens=max_new_tokens,
                                       do_sample=False, attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long),
                                       eos_token_id=None)
    return out[0, -max_new_tokens:].tolist()


def hf_input_embeddings(path: str, token_ids: list[int]):
    """transformers' input embeddings of these tokens: what a prompt given as embeddings holds for them."""
    import torch

    with torch.no_grad():
        return _hf_model(path).get_input_embeddings()(torch.tensor(token_ids)).float()


def hf_state_dict(path: str) -> dict:
    """transformers' model's weights by checkpoint name (float32 copies): what an RL trainer would push."""
    return {name: tensor.detach().clone() for name, tensor in _hf_model(path).state_dict().items()}


def hf_greedy_with(path: str, replaced: dict, prompt_ids: list[int], max_new_tokens: int,
                   **generate_kwargs) -> list[int]:
    """`hf_greedy` for the checkpoint at `path` with the weights in `replaced` (name -> tensor) swapped in."""
    import torch

    model = _causal_lm(path).eval()
    with torch.no_grad():
        for name, tensor in replaced.items():
            model.get_parameter(name).copy_(tensor)
    return model_greedy(model, prompt_ids, max_new_tokens, **generate_kwargs)


def hf_logits(path: str, token_ids: list[int]):
    """transformers' float32 logits at every position of one sequence: ``[len(token_ids), vocab]``."""
    return model_logits(_hf_model(path), token_ids)


def greedy_divergence(path: str, prompt_ids: list[int], expected: list[int], got: list[int]) -> str:
    """Where ``got`` first leaves transformers' greedy ``expected`` tokens, and by how much transformers' logit for
    its own token led the other one there: a lead within the arithmetic's error (float32's about 1e-6 on the tiny
    models, TF32's 1e-3) is a near-tie it flips, a wider one a wrong result. For an assertion's message."""
    i = first_difference(expected, got)
    if i == len(expected) or i == len(got):
        return f"{len(got)} tokens where transformers gives {len(expected)}, equal up to there"
    logits = hf_logits(path, prompt_ids + expected[:i])[-1]
    lead = float(logits[expected[i]] - logits[got[i]])
    return f"token {i}: {got[i]} where transformers gives {expected[i]}, whose logit leads by {lead:.2e}"


def first_difference(expected: list[int], got: list[int]) -> int:
    """The first position where ``got`` and ``expected`` differ, or the shorter one's length where none does."""
    return next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))


def assert_greedy_until_a_near_tie(logits_of, prompt_ids: list[int], expected: list[int], got: list[int],
                                   near_tie: float) -> None:
    """``got`` equals a reference's greedy ``expected`` tokens over their common length, or differs first where the
    reference's top two logprobs are closer than ``near_tie`` (a rounding error may rightly flip such an argmax).
    ``logits_of``: the reference's logits of a token sequence, ``[len, vocab]`` (`hf_logits`, a test's own model)."""
    import torch

    i = first_difference(expected, got)
    if i == min(len(expected), len(got)):
        return
    top2 = torch.log_softmax(logits_of(prompt_ids + expected[:i])[-1].double(), -1).topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < near_tie, (f"token {i}: {got[i]} where the reference gives {expected[i]}, its top two logprobs "
                               f"{margin:.3g} apart (a near-tie: under {near_tie}); {expected} != {got}")


def model_logits(model, token_ids: list[int]):
    """`hf_logits` for a transformers model already built."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
    return out.logits[0].float()


@functools.lru_cache(maxsize=None)
def _hf_base(path: str):
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def hf_last_hidden_state(path: str, token_ids: list[int]) -> list[float]:
    """transformers' final hidden state (after the last norm) of one sequence's last token, in float32."""
    import torch

    with torch.no_grad():
        return _hf_base(path)(torch.tensor([token_ids])).last_hidden_state[0, -1].tolist()


def hf_last_hidden_states(path: str, token_ids: list[int]) -> list[list[float]]:
    """transformers' final hidden states (after the last norm) of every token of one sequence, in float32."""
    import torch

    with torch.no_grad():
        return _hf_base(path)(torch.tensor([token_ids])).last_hidden_state[0].tolist()
