"""Finding, reading and loading checkpoints: sharded, dummy, broken, hub cache, dtypes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from model_utils import PagedRun, hf_logits, save_tiny_checkpoint, tiny_hf_config
from safetensors.torch import load_file, save_file

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.loader import (
    checkpoint_files,
    load_hf_config,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from asyncllm.models.registry import KVCacheSpec, get_model_class, kv_cache_spec
from asyncllm.models.rotary import compute_inv_freq
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_checkpoint(path, "llama")
    return path


def _load(path: Path | str, **fields) -> torch.nn.Module:
    config = EngineConfig.create(str(path), **fields)
    return load_model(config, load_hf_config(str(path)), CPU, torch.float32)


def _logits(model, hf_config, tokens: list[int]) -> torch.Tensor:
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, [tokens])
    run.new_kv_caches_for(spec, next(model.parameters()).dtype)
    return run.run([[len(tokens)]])[0]


def test_sharded_checkpoint_with_index(tmp_path):
    hf_model = save_tiny_checkpoint(tmp_path, "qwen3", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 3
    assert [os.path.basename(f) for f in checkpoint_files(str(tmp_path))] == shard_files
    model = _load(tmp_path)
    tokens = [5, 17, 3, 99, 42, 8, 0, 64]
    expected = hf_logits(hf_model, tokens)
    torch.testing.assert_close(_logits(model, load_hf_config(str(tmp_path)), tokens), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("index", ["{", "{}", '{"weight_map": []}'], ids=["broken-json", "no-map", "not-a-map"])
def test_a_broken_index_is_a_config_error_naming_it(tmp_path, index):
    save_tiny_checkpoint(tmp_path, "qwen3", max_shard_size="40KB")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json.*weight_map") as info:
        _load(tmp_path)
    assert info.value.field == "model"


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_shard_is_a_config_error_naming_it(tmp_path, damage):
    """An interrupted download's shard: its name, not safetensors' bare "incomplete metadata"."""
    save_tiny_checkpoint(tmp_path, "qwen3", max_shard_size="40KB")
    shard = tmp_path / "model-00002-of-00014.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not safetensors")
    with pytest.raises(ConfigError, match=r"model-00002-of-00014\.safetensors.*a readable safetensors file"):
        _load(tmp_path)


def test_dummy_weights_real_shapes_deterministic(tmp_path, llama_dir):
    tiny_hf_config("llama", architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)  # config only
    real = dict(_load(llama_dir).named_parameters())
    first = dict(_load(tmp_path, load_format="dummy", seed=3).named_parameters())
    again = dict(_load(tmp_path, load_format="dummy", seed=3).named_parameters())
    other = dict(_load(tmp_path, load_format="dummy", seed=4).named_parameters())
    assert {n: p.shape for n, p in first.items()} == {n: p.shape for n, p in real.items()}
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert torch.equal(first["model.norm.weight"], torch.ones(64))
    assert abs(first["model.layers.1.mlp.down_proj.weight"].std().item() - 0.02) < 0.002


def test_dummy_weights_finite_in_bfloat16(tmp_path):
    tiny_hf_config("qwen3", architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    hf_config = load_hf_config(str(tmp_path))
    model = load_model(EngineConfig.create(str(tmp_path), load_format="dummy"), hf_config, CPU, torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    logits = _logits(model, hf_config, list(range(12)))
    assert logits.dtype == torch.float32 and logits.shape == (12, 101)
    assert bool(torch.isfinite(logits).all()) and logits.abs().max() > 0


def _rewrite_checkpoint(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_weight_is_named(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    _rewrite_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing: model\.layers\.1\.self_attn\.k_proj\.weight$"):
        _load(tmp_path)


def test_unexpected_weight_is_named(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(ConfigError, match=r"unexpected weights: model\.layers\.0\.self_attn\.extra\.weight"):
        _load(tmp_path)


def test_mismatched_shape_is_a_config_error(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(ConfigError, match=r"model\.norm\.weight.*shape \(32,\), the model expects \(64,\)"):
        _load(tmp_path)


def test_ignored_names_and_tied_lm_head(tmp_path):
    """A rotary inv_freq buffer and a tied checkpoint's lm_head copy are skipped, not errors."""
    hf_model = save_tiny_checkpoint(tmp_path, "qwen2")  # tied
    embed = hf_model.model.embed_tokens.weight.detach().clone()
    _rewrite_checkpoint(
        tmp_path,
        lambda t: t.update({"lm_head.weight": embed, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
    )
    model = _load(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, embed)


def test_no_weights_is_a_config_error(tmp_path):
    tiny_hf_config("llama", architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"pytorch_model\*\.bin or \*\.pt weights; it has none"):
        _load(tmp_path)


def _as_pickles(src: Path, dst: Path, shards: int) -> None:
    """``src``'s config and weights, the weights as ``shards`` PyTorch pickle files (with an index when several)."""
    shutil.copy(src / "config.json", dst / "config.json")
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return
    weight_map = {}
    for shard in range(shards):
        file = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        part = {name: state[name] for name in names[shard::shards]}
        torch.save(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_pickle_checkpoints_load_as_their_safetensors(llama_dir, tmp_path, shards):
    """A folder of ``pytorch_model*.bin`` (one file, or shards with their index) loads the same weights under
    ``auto`` and ``pt``; ``safetensors`` refuses it."""
    _as_pickles(llama_dir, tmp_path, shards)
    expected = dict(_load(llama_dir).named_parameters())
    for load_format in ("auto", "pt"):
        got = dict(_load(tmp_path, load_format=load_format).named_parameters())
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)
    with pytest.raises(ConfigError, match="load_format='auto' or 'pt' reads"):
        _load(tmp_path, load_format="safetensors")


class _NotATensor:
    pass


def test_a_pickle_with_code_objects_is_refused_unread(llama_dir, tmp_path):
    """``weights_only=True``: a pickle that would construct arbitrary objects is a ConfigError, nothing runs."""
    _as_pickles(llama_dir, tmp_path, 1)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    state["extra"] = _NotATensor()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="a PyTorch checkpoint of tensors only"):
        _load(tmp_path)


def test_unknown_architecture_is_not_built(tmp_path):
    config = tiny_hf_config("llama", architectures=["T5ForConditionalGeneration"])
    with pytest.raises(NotBuiltError, match=r"T5ForConditionalGeneration architecture \(supported: LlamaForCausalLM, Mistral"):
        get_model_class(config)


def test_length_dependent_rope_is_not_built():
    config = tiny_hf_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(NotBuiltError, match="rope_type='dynamic'"):
        compute_inv_freq(config, 16)


def test_load_hf_config_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_config(str(tmp_path))


def test_hub_id_absent_offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE is read when the path is resolved, not only at huggingface_hub's import (which reads it once)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as info:
        resolve_model_path("some-org/not-downloaded")
    message = str(info.value)
    assert "not a folder, not in the cache" in message and str(tmp_path) in message and "offline mode is on" in message
    assert "HF_HUB_OFFLINE=0" in message and "huggingface-cli download some-org/not-downloaded" in message


def test_not_a_folder_nor_a_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="no such folder: /no/such/folder/anywhere"):
        resolve_model_path("/no/such/folder/anywhere")
    with pytest.raises(ConfigError, match="is neither"):
        resolve_model_path("not a/hub id")


@pytest.mark.parametrize("pickles", [False, True])
def test_hub_id_in_the_hf_cache_loads(tmp_path, monkeypatch, llama_dir, pickles):
    """From the cache, offline; a snapshot without safetensors is read from its pytorch_model.bin."""
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / revision
    if pickles:
        snapshot.mkdir(parents=True)
        _as_pickles(llama_dir, snapshot, 1)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (llama_dir / name).exists():
                shutil.copy(llama_dir / name, snapshot / name)
    else:
        shutil.copytree(llama_dir, snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    path = resolve_model_path("tiny-org/tiny-llama")
    assert Path(path).resolve() == snapshot.resolve()
    model = load_model(EngineConfig.create("tiny-org/tiny-llama"), load_hf_config(path), CPU, torch.float32)
    reference = dict(_load(llama_dir).named_parameters())
    assert all(torch.equal(p, reference[n]) for n, p in model.named_parameters())


def test_download_dir_is_the_cache_a_hub_id_is_read_from(tmp_path, monkeypatch):
    """``download_dir`` over HF_HUB_CACHE: the engine's preparation finds the snapshot there (offline), and the
    error of a hub id found nowhere names that folder."""
    from asyncllm.engine.prepare import prepare

    cache = tmp_path / "downloads"
    revision = "89abcdef0123456789abcdef0123456789abcdef"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / revision
    shutil.copytree(tiny_checkpoint("llama"), snapshot)  # with its tokenizer
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="elsewhere"):
        resolve_model_path("tiny-org/tiny-llama")
    prepared = prepare(EngineConfig.create("tiny-org/tiny-llama", download_dir=str(cache)))
    assert Path(prepared.config.model).resolve() == snapshot.resolve()
    with pytest.raises(ConfigError, match="downloads"):
        resolve_model_path("tiny-org/other", download_dir=str(cache))
    with pytest.raises(ConfigError, match="download_dir"):
        EngineConfig.create("m", download_dir="")


def test_an_uncached_revision_names_it_and_the_command_that_fetches_it(tmp_path, monkeypatch):
    """The repo cached at main but not at the revision asked, offline: the error names the revision, and the
    command it suggests downloads that revision into ``download_dir`` (not main into huggingface_hub's default)."""
    repo = tmp_path / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_checkpoint("llama"), repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(resolve_model_path("tiny-org/tiny-llama", None, str(tmp_path))).name == "a" * 40
    with pytest.raises(ConfigError) as info:
        resolve_model_path("tiny-org/tiny-llama", "v2", str(tmp_path))
    message = str(info.value)
    assert "not in the cache at revision 'v2'" in message
    assert f"`huggingface-cli download tiny-org/tiny-llama --revision v2 --cache-dir {tmp_path}`" in message


def test_tokenizer_revision_without_tokenizer_reads_the_model_repo_at_it(tmp_path, monkeypatch):
    """vLLM's ``tokenizer_revision`` with no ``tokenizer``: the model repo's tokenizer at that revision (its
    snapshot without weights), the model at its own; a local model has no revisions (a ConfigError)."""
    from asyncllm.engine.prepare import prepare

    repo = tmp_path / "models--tiny-org--tiny-llama"
    for ref, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(tiny_checkpoint("llama"), snapshot, ignore=shutil.ignore_patterns(*(
            ["*.safetensors"] if ref == "v2" else [])))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    tokenizer_config = repo / "snapshots" / ("b" * 40) / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "model_max_length": 77}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prepared = prepare(EngineConfig.create("tiny-org/tiny-llama", download_dir=str(tmp_path), tokenizer_revision="v2"))
    assert prepared.tokenizer.model_max_length == 77
    assert Path(prepared.config.tokenizer).name == "b" * 40 and Path(prepared.config.model).name == "a" * 40
    with pytest.raises(ConfigError) as info:
        prepare(EngineConfig.create(tiny_checkpoint("llama"), tokenizer_revision="v2"))
    assert info.value.field == "tokenizer_revision"


def test_local_folder_is_itself(llama_dir):
    assert resolve_model_path(str(llama_dir)) == str(llama_dir)


@pytest.mark.parametrize(
    ("dtype", "ckpt_dtype", "device", "expected"),
    [
        ("auto", "bfloat16", "cpu", torch.float32),
        ("auto", "float16", "cuda", torch.float16),
        ("auto", "bfloat16", "cuda", torch.bfloat16),
        ("auto", "float32", "cuda", torch.bfloat16),
        ("auto", None, "cuda", torch.bfloat16),
        ("float16", "bfloat16", "cpu", torch.float16),
        ("float32", "bfloat16", "cuda", torch.float32),
    ],
)
def test_resolve_dtype(dtype, ckpt_dtype, device, expected):
    config = tiny_hf_config("llama")
    config.dtype = ckpt_dtype
    assert resolve_dtype(dtype, config, torch.device(device)) is expected


@pytest.mark.parametrize(("model_type", "outer", "text", "pooling", "expected"), [
    ("llama", "float32", None, True, torch.float16),  # vLLM prefers float16 for a pooling model's float32 weights
    ("llama", None, None, True, torch.float16),
    ("llama", "bfloat16", None, True, torch.bfloat16),  # a half type is kept
    ("gemma2", "float16", None, False, torch.bfloat16),  # float16 unstable for Gemma 2 / 3, GLM-4 (vLLM's list)
    ("gemma3_text", "float32", None, True, torch.bfloat16),  # EmbeddingGemma: not float16 either
    ("glm4", "float16", None, False, torch.bfloat16),
    ("llava", None, "float16", False, torch.float16),  # an image-text config giving it in text_config only
    ("llava", "bfloat16", "float16", False, torch.bfloat16),  # the outer one first
])
def test_auto_dtype_on_gpu_follows_vllm(model_type, outer, text, pooling, expected):
    """vLLM's ``_get_and_verify_dtype``: the config's dtype, else its text config's; float32 (or none) downcast to
    float16 for pooling models, bfloat16 otherwise; never float16 for the models it is unstable for."""
    from types import SimpleNamespace

    config = SimpleNamespace(model_type=model_type, dtype=outer,
                             text_config=SimpleNamespace(dtype=text) if text is not None else None)
    assert resolve_dtype("auto", config, torch.device("cuda"), pooling=pooling) is expected
    assert resolve_dtype("auto", config, CPU, pooling=pooling) is torch.float32  # CPU: float32 always


def test_kv_cache_spec_and_tp_checks():
    qwen3 = tiny_hf_config("qwen3")  # 4 heads, 2 KV heads, head_dim 32
    assert kv_cache_spec(qwen3, 1) == KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32)
    assert kv_cache_spec(qwen3, 2) == KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=32)
    assert kv_cache_spec(qwen3, 4) == KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=32)  # replicated
    assert kv_cache_spec(qwen3, 1).bytes_per_block(16, torch.bfloat16) == 2 * 2 * 16 * 2 * 32 * 2
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        kv_cache_spec(qwen3, 3)


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3", "llava", "gpt2", "gptj", "gpt_bigcode"])
def test_workers_rebuild_the_hosts_config(family: str, tmp_path: Path) -> None:
    """The config a worker rebuilds from the host's JSON (no config class) builds the same model; transformers'
    aliases (GPT-2's ``num_attention_heads`` for ``n_head``) travel too (without them GPT-2, GPT-J and GPTBigCode
    could not start a worker)."""
    from asyncllm.models.checkpoint import hf_config_from_json, hf_config_json

    if family == "llava":
        from mm_utils import make_tiny_llava

        path = make_tiny_llava(tmp_path / "llava")
    elif family.startswith("gpt"):
        from asyncllm.tiny import tiny_checkpoint

        path = tiny_checkpoint(family)
    else:
        save_tiny_checkpoint(tmp_path, family)
        path = str(tmp_path)
    read = load_hf_config(path)
    rebuilt = hf_config_from_json(hf_config_json(read))
    assert type(rebuilt).__name__ == "WireConfig"  # no config class (and no transformers) was needed
    assert rebuilt.num_labels == read.num_labels  # a PretrainedConfig property the classifier reads
    assert all(getattr(rebuilt, alias) == getattr(read, alias) for alias in read.attribute_map)
    config = EngineConfig.create(path, max_model_len=64)
    first, second = (load_model(config, c, CPU, torch.float32) for c in (read, rebuilt))
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(first.buffers(), second.buffers()))
    assert kv_cache_spec(read, 1) == kv_cache_spec(rebuilt, 1)


def test_hf_overrides_set_keys_and_update_nested_configs() -> None:
    import transformers

    from asyncllm.models.checkpoint import apply_hf_overrides

    config = transformers.LlavaConfig(text_config={"model_type": "llama", "hidden_size": 64})
    apply_hf_overrides(config, {"text_config": {"max_position_embeddings": 99}, "image_seq_length": 7, "new_key": [1]})
    assert (config.text_config.max_position_embeddings, config.text_config.hidden_size) == (99, 64)
    assert (config.image_seq_length, config.new_key) == (7, [1])
    with pytest.raises(ConfigError, match="hf_overrides"):
        EngineConfig.create("some/model", hf_overrides={"x": object()})


def test_trust_remote_code_runs_a_checkpoints_own_config_class(tmp_path: Path, tiny_llama: str) -> None:
    """A config.json whose ``auto_map`` names the checkpoint's own config class: refused naming trust_remote_code,
    read with it (the model is still asyncllm's class of its architecture)."""
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import ConfigError

    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_llama, name), tmp_path)
    (tmp_path / "configuration_mine.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MineConfig(LlamaConfig):\n    model_type = 'mine'\n")
    with open(os.path.join(tiny_llama, "config.json")) as f:
        config = json.load(f)
    config.update(model_type="mine", auto_map={"AutoConfig": "configuration_mine.MineConfig"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="trust_remote_code=False .*auto_map"):
        prepare(EngineConfig.create(str(tmp_path)))
    prepared = prepare(EngineConfig.create(str(tmp_path), trust_remote_code=True))
    read = load_hf_config(str(tmp_path), trust_remote_code=True)
    assert type(read).__name__ == "MineConfig" and prepared.vocab_size == read.vocab_size
    model = load_model(EngineConfig.create(str(tmp_path), max_model_len=64), read, CPU, torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_disable_sliding_window_caps_max_model_len_at_the_window() -> None:
    """vLLM's disable_sliding_window: no sequence outgrows the window (Gemma 2's tiny one: 8 tokens), so every
    layer attends to it all; a longer max_model_len is refused naming the window; models without one unchanged."""
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import ConfigError
    from asyncllm.tiny import tiny_checkpoint

    gemma2, llama = tiny_checkpoint("gemma2"), tiny_checkpoint("llama")
    assert prepare(EngineConfig.create(gemma2, disable_sliding_window=True)).config.max_model_len == 8
    assert prepare(EngineConfig.create(gemma2)).config.max_model_len == 2048
    assert prepare(EngineConfig.create(llama, disable_sliding_window=True)).config.max_model_len == 2048
    with pytest.raises(ConfigError, match=r"at most the sliding window \(disable_sliding_window\) \(8\)"):
        prepare(EngineConfig.create(gemma2, disable_sliding_window=True, max_model_len=16))
