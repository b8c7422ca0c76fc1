"""Checkpoints of bare decoders (``LlamaModel``, ``Qwen3Model``, ``Gemma2Model``, a hybrid's ``Qwen3NextModel``: what
AutoModel saves, as embedding models ship)
load without an LM head and serve embeddings equal to transformers'; generation is refused by name."""

from __future__ import annotations

import os
import shutil

import pytest

from asyncllm import AsyncEngine, InvalidRequestError
from asyncllm.tiny import tiny_checkpoint


def _bare_decoder(source: str, folder: str) -> str:
    """`source`'s decoder saved alone (AutoModel's checkpoint: no ``model.`` prefix, no lm_head)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(folder)
    for name in os.listdir(source):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(os.path.join(source, name), folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "qwen3_next", "gemma3"])  # bge-multilingual-gemma2;
# a hybrid; a causal Gemma3TextModel (not EmbeddingGemma: its Gemma 3 causal decoder, LAST pooling)
async def test_a_bare_decoder_serves_embeddings_only(family: str, tmp_path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel

    path = _bare_decoder(tiny_checkpoint(family), str(tmp_path / family))
    assert AutoConfig.from_pretrained(path).architectures[0].endswith("Model")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert not any(name.startswith(("model.", "lm_head")) for name in f.keys())
    prompt = [5, 9, 14, 3, 77, 21]
    async with AsyncEngine(path, disable_log_stats=True) as engine:
        out = await engine.embed(prompt)
        with pytest.raises(InvalidRequestError, match="embeddings only") as info:
            await engine.generate(prompt)
        assert info.value.field == "prompt"
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(path, dtype=torch.float32)(torch.tensor([prompt])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(hidden, dim=0)
    assert (torch.tensor(out.embedding) - want).abs().max() < 1e-5


async def test_a_bare_decoder_takes_adapters_trained_on_it_or_on_its_causal_lm(tmp_path) -> None:
    """An embedding model's adapter trained on ``AutoModel`` (PEFT names ``base_model.model.layers...``) and one
    trained on the causal LM (``base_model.model.model.layers...``): each embedding equals PEFT's over the model it
    was trained on."""
    import torch
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM

    from asyncllm.lora import LoRARequest
    from lora_utils import make_adapter

    source = tiny_checkpoint("llama")
    folder = str(tmp_path)
    path = _bare_decoder(source, os.path.join(folder, "bare"))
    on_bare = make_adapter(path, os.path.join(folder, "on_bare"), seed=5, auto_class=AutoModel)
    on_causal = make_adapter(source, os.path.join(folder, "on_causal"), seed=6)
    prompt = [5, 9, 14, 3, 77]
    async with AsyncEngine(path, enable_lora=True, max_lora_rank=8, disable_log_stats=True) as engine:
        outs = [await engine.embed(prompt, lora_request=LoRARequest(name, i + 1, adapter))
                for i, (name, adapter) in enumerate((("bare", on_bare), ("causal", on_causal)))]
    with torch.no_grad():
        bare = PeftModel.from_pretrained(AutoModel.from_pretrained(path, dtype=torch.float32), on_bare).eval()
        causal = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32),
                                           on_causal).eval()
        wants = [bare(torch.tensor([prompt])).last_hidden_state[0, -1],
                 causal(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]]
    for out, want in zip(outs, wants):
        assert (torch.tensor(out.embedding) - torch.nn.functional.normalize(want, dim=0)).abs().max() < 1e-5
    assert (torch.tensor(outs[0].embedding) - torch.tensor(outs[1].embedding)).abs().max() > 1e-2
