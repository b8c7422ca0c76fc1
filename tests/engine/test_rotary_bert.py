"""The rotary BERTs beyond tests/engine/test_encoder_embeddings.py (which serves transformers' native NomicBERT over
two ranks and GTE): NomicBERT (``NomicBertModel``, nomic-embed-text) under the hub's config, the remote code's names
(``n_embd``, ``n_head``, ``rotary_emb_base``, ``max_trained_positions`` ...) read on the host, equal to
transformers' own ``NomicBertModel`` on the same weights; GTE under vLLM's ``GteNewModel`` name; the settings
asyncllm does not build refused by name before anything starts."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from encoder_utils import hf_pair_logits, hf_sentence_embedding, make_tiny_encoder

from asyncllm import AsyncEngine, NotBuiltError

TEXTS = ["what is paged attention?", "the engine", "a query of a document: 42 tokens, then more words!"]
_HUB_KEYS = {"activation_function": "swiglu", "prenorm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
             "mlp_fc2_bias": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
             "rotary_emb_scale_base": None, "rotary_emb_base": 1000, "n_positions": 8192, "causal": False}


def _hub_form(native: str, folder: Path, **changes) -> str:
    """The native checkpoint's weights and tokenizer under a config.json written as the hub's (the remote code's
    names only; transformers' defaults for its own names, 768 wide, are what a reader ignoring them would get)."""
    folder.mkdir()
    for item in Path(native).iterdir():
        if item.is_file() and item.name != "config.json":
            (folder / item.name).write_bytes(item.read_bytes())
        elif item.is_dir():
            (folder / item.name).mkdir()
            for sub in item.iterdir():
                (folder / item.name / sub.name).write_bytes(sub.read_bytes())
    config = json.loads((Path(native) / "config.json").read_text())
    hub = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "vocab_size": config["vocab_size"],
           "type_vocab_size": 2, "pad_token_id": 0, "n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 64,
           "layer_norm_epsilon": 1e-12, "max_trained_positions": 48, **_HUB_KEYS, **changes}
    (folder / "config.json").write_text(json.dumps(hub))
    return str(folder)


async def test_the_hubs_config_names_are_read(tmp_path) -> None:
    native = make_tiny_encoder(tmp_path / "native", "nomic", pooling="mean")
    hub = _hub_form(native, tmp_path / "hub")
    async with AsyncEngine(hub, disable_log_stats=True, max_worker_restarts=0) as engine:
        assert engine.config.max_model_len == 48  # the trained positions, not n_positions (vLLM's default)
        outs = await asyncio.gather(*(engine.embed(text) for text in TEXTS))
    for text, out in zip(TEXTS, outs):
        np.testing.assert_allclose(out.embedding, hf_sentence_embedding(native, text, "mean"), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("change", "words"), [
    ({"prenorm": True}, "pre-LN layers"), ({"qkv_proj_bias": True}, "projection biases"),
    ({"activation_function": "gelu"}, "non-gated MLP"), ({"rotary_emb_fraction": 0.5}, "partial rotary"),
    ({"moe_every_n_layers": 2}, "expert layers")])
async def test_settings_not_built_are_refused_by_name(tmp_path, change, words) -> None:
    native = make_tiny_encoder(tmp_path / "native", "nomic")
    hub = _hub_form(native, tmp_path / "hub", **change)
    with pytest.raises(NotBuiltError, match=words) as info:
        async with AsyncEngine(hub, disable_log_stats=True):
            pass
    assert next(iter(change)) in str(info.value)


async def test_gte_under_vllms_gte_new_model_name_and_its_options_not_built(tmp_path) -> None:
    """``hf_overrides={"architectures": ["GteNewModel"]}`` (vLLM's advice for Alibaba's ``NewModel`` checkpoints)
    serves the same model; a remote-code option other than the published checkpoints' is refused by name."""
    path = make_tiny_encoder(tmp_path / "gte", "gte", pooling="mean")
    async with AsyncEngine(path, hf_overrides={"architectures": ["GteNewModel"]}, disable_log_stats=True) as engine:
        out = await engine.embed(TEXTS[2])
    np.testing.assert_allclose(out.embedding, hf_sentence_embedding(path, TEXTS[2], "mean"), rtol=0, atol=1e-5)
    with pytest.raises(NotBuiltError, match="logn_attention_scale=True"):
        async with AsyncEngine(path, hf_overrides={"logn_attention_scale": True}, disable_log_stats=True):
            pass


def _with_rope(source: str, folder: Path, **rope) -> str:
    """The checkpoint at ``source`` in ``folder`` with its rope settings replaced by ``rope`` (config.json keys)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps({**config, **rope}))
    return str(folder)


async def test_gte_v15_ntk_rope_is_transformers_linear_rope_of_a_scaled_base(tmp_path) -> None:
    """gte-*-en-v1.5's ``rope_scaling: {"type": "ntk", "factor": 2.0}`` (the remote code's and vLLM's fixed NTK
    scaling: base theta * f, every frequency divided by f ** (2 / head_dim)) is, term for term, transformers' linear
    rope of base theta * f and factor f ** (2 / head_dim): the engine's embeddings under the first equal
    transformers' GteModel under the second on the same weights; the "mixed" form is refused by name."""
    path = make_tiny_encoder(tmp_path / "gte", "gte", pooling="mean")  # head_dim 8
    ntk = _with_rope(path, tmp_path / "ntk", rope_theta=1000.0, rope_scaling={"type": "ntk", "factor": 2.0})
    linear = _with_rope(path, tmp_path / "linear", rope_parameters={
        "rope_type": "linear", "rope_theta": 2000.0, "factor": 2.0 ** (2 / 8)})
    async with AsyncEngine(ntk, disable_log_stats=True, max_worker_restarts=0) as engine:
        assert engine.config.max_model_len == 2 * 66  # max_position_embeddings times the factor, as vLLM derives it
        outs = await asyncio.gather(*(engine.embed(text) for text in TEXTS))
    for text, out in zip(TEXTS, outs):
        np.testing.assert_allclose(out.embedding, hf_sentence_embedding(linear, text, "mean"), rtol=0, atol=1e-5)
    unscaled = _with_rope(path, tmp_path / "unscaled", rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    moved = np.asarray(hf_sentence_embedding(unscaled, TEXTS[2], "mean")) - np.asarray(outs[2].embedding)
    assert np.abs(moved).max() > 1e-4  # the scaling moves this tiny model's embedding 10x past the tolerance
    mixed = _with_rope(path, tmp_path / "mixed", rope_theta=1000.0,
                       rope_scaling={"type": "ntk", "factor": 2.0, "mixed_b": 0.3})
    with pytest.raises(NotBuiltError, match="mixed_b"):
        async with AsyncEngine(mixed, disable_log_stats=True):
            pass


async def test_gte_reranker_under_vllms_name_reads_the_remote_codes_names(tmp_path) -> None:
    """A GTE cross-encoder saved as Alibaba's ``NewForSequenceClassification`` names its tensors ``new.*`` (the
    encoder and its pooler) and ``classifier.*``; under vLLM's ``GteNewForSequenceClassification`` it scores as
    transformers' ``GteForSequenceClassification`` does on the same weights."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_encoder(tmp_path / "gte", "gte", num_labels=1)
    remote = tmp_path / "remote"
    shutil.copytree(path, remote)
    weights = load_file(str(remote / "model.safetensors"))
    save_file({name.replace("gte.", "new.", 1): tensor for name, tensor in weights.items()},
              str(remote / "model.safetensors"))
    assert any(name.startswith("new.pooler.") for name in load_file(str(remote / "model.safetensors")))
    overrides = {"architectures": ["GteNewForSequenceClassification"]}
    async with AsyncEngine(str(remote), hf_overrides=overrides, disable_log_stats=True) as engine:
        [score] = await engine.score(TEXTS[0], [TEXTS[2]])
    [logit] = hf_pair_logits(path, TEXTS[0], TEXTS[2])
    assert score.score == pytest.approx(1 / (1 + np.exp(-logit)), abs=1e-5)
