"""What a weight update refuses by name and shape before it writes anything, and the tied models it updates
(workers/weight_update.py, docs/weight-updates.md): a refusal is a typed reply, the model is unchanged and the worker
serves on."""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.weight_update import weights_error
from asyncllm.errors import InvalidRequestError
from asyncllm.models.loader import load_hf_config
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers.weight_update import check_update, update_weights
from test_weight_update_checks import _params, _push, _runner

CPU = torch.device("cpu")


def test_bad_expert_tensors_and_parameter_names_are_refused_and_the_worker_serves_on() -> None:
    runner = _runner(tiny_checkpoint("qwen3_moe"))
    moe = runner.model.model.layers[0].mlp.experts
    experts, inter, hidden = moe.num_experts, moe.intermediate, moe.hidden_size
    before = _params(runner.model)
    refused = {  # name -> (tensor, what the refusal says)
        f"model.layers.0.mlp.experts.{experts + 3}.up_proj.weight": (torch.ones(inter, hidden), "ids 0..7"),
        "model.layers.0.mlp.experts.1.up_proj.weight": (torch.ones(inter + 1, hidden), r"up matrix is \(32, 64\)"),
        "model.layers.0.mlp.experts.1.down_proj.weight": (torch.ones(hidden, inter + 5), r"down matrix is \(64, 32\)"),
        "model.layers.0.mlp.experts.w13_weight": (torch.ones(experts, 2 * inter, hidden), "fuses"),  # loaders' own
        "model.layers.0.mlp.experts.gate_up_proj": (torch.ones(experts + 1, 2 * inter, hidden), "ids 0..7"),  # stacked
        "model.layers.0.mlp.experts.down_proj": (torch.ones(experts, inter, hidden), r"down matrix is \(64, 32\)"),
        "model.layers.0.self_attn.qkv_proj.weight": (torch.ones(4, hidden), "fuses"),
        "model.layers.0.self_attn.o_proj.weight": (torch.ones(hidden), "IndexError"),  # the wrong rank
    }
    for name, (tensor, reason) in refused.items():
        reply = _push(runner, {"model.norm.weight": torch.zeros(hidden), name: tensor})
        error = weights_error(reply)
        assert isinstance(error, InvalidRequestError) and error.field == "named_tensors", name
        assert name in reply.error and re.search(reason, reply.error), reply.error
    assert all(torch.equal(param, before[name]) for name, param in runner.model.named_parameters())
    up = torch.randn(inter, hidden)
    assert _push(runner, {"model.layers.0.mlp.experts.1.up_proj.weight": up}) == protocol.WeightsUpdated("t")
    assert torch.equal(moe.w13_weight[1, inter:], up)  # the up rows of expert 1, after its gate rows


def test_a_pushed_tied_head_is_the_embedding_and_skipped_tensors_keep_their_shapes() -> None:
    """workers/pushed_weights.py: what the loader skips in files is checked when pushed, a tied head written into
    the embedding (one parameter, as transformers ties them)."""
    runner = _runner(tiny_checkpoint("gemma3"))  # tied embeddings, rotary tables of 16 dims
    embedding = runner.model.model.embed_tokens.weight
    before, head = _params(runner.model), torch.randn(embedding.shape)
    refused = [  # (pushed, what the refusal says)
        ({"lm_head.weight": torch.zeros(3)}, r"'lm_head.weight' of the tied embedding's shape \[512, 64\].*got \[3\]"),
        ({"model.rotary_emb.inv_freq": torch.zeros(5)}, r"shape \(\[8\];.*'model.rotary_emb.inv_freq' of shape \[5\]"),
        ({"model.embed_tokens.weight": head, "lm_head.weight": head + 1}, "'lm_head.weight' equal to 'model.embed"),
    ]
    for pushed, reason in refused:
        reply = _push(runner, pushed)
        error = weights_error(reply)
        assert isinstance(error, InvalidRequestError) and error.field == "named_tensors", reply
        assert re.search(reason, reply.error), reply.error
    assert all(torch.equal(param, before[name]) for name, param in runner.model.named_parameters())
    accepted = {"lm_head.weight": head, "model.rotary_emb.inv_freq": torch.ones(8)}  # inv_freq: ignored
    assert _push(runner, accepted) == protocol.WeightsUpdated("t")
    assert torch.equal(embedding, head)  # the head, which is the embedding
    assert _push(runner, {"model.embed_tokens.weight": -head, "lm_head.weight": -head}) == protocol.WeightsUpdated("t")
    assert torch.equal(embedding, -head)


def _tied_qwen_vl(folder: Path) -> str:
    """A tiny Qwen2-VL's config.json with tied embeddings (as Qwen2-VL-2B ships: the flag on the outer config), to
    serve with dummy weights."""
    from transformers import Qwen2VLConfig

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=14)
    Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=500,
                  video_token_id=501, architectures=["Qwen2VLForConditionalGeneration"]).save_pretrained(folder)
    return str(folder)


def test_a_tied_head_is_pushed_into_the_parameter_it_shares_in_an_image_text_model(tmp_path: Path) -> None:
    runner = _runner(_tied_qwen_vl(tmp_path / "vl"), load_format="dummy")
    embedding = runner.model.language_model.model.embed_tokens.weight  # the decoder's, under the wrapper's prefix
    head = torch.randn(embedding.shape)
    for pushed, reason in [({"lm_head.weight": torch.zeros(3)}, r"tied embedding's shape \[512, 64\].*got \[3\]"),
                           ({"model.language_model.embed_tokens.weight": head, "lm_head.weight": head + 1},
                            "'lm_head.weight' equal to 'model.language_model.embed_tokens.weight'")]:
        reply = _push(runner, pushed)
        assert isinstance(weights_error(reply), InvalidRequestError) and re.search(reason, reply.error), reply
    assert not _push(runner, {"lm_head.weight": head}).error
    assert torch.equal(embedding, head)


def test_a_tied_head_takes_the_embeddings_shape() -> None:
    runner = _runner(tiny_checkpoint("opt", word_embed_proj_dim=32))  # hidden_size 64: the embedding is [512, 32]
    embedding = runner.model.model.embed_tokens.weight
    reply = _push(runner, {"lm_head.weight": torch.zeros(512, 64)})
    assert re.search(r"tied embedding's shape \[512, 32\].*got \[512, 64\]", reply.error), reply
    head = torch.randn(512, 32)
    assert _push(runner, {"lm_head.weight": head}) == protocol.WeightsUpdated("t") and torch.equal(embedding, head)


@pytest.mark.parametrize("arch, name", [("gpt2", "transformer.wte.weight"), ("gpt_bigcode", "transformer.wte.weight"),
                                        ("bloom", "transformer.word_embeddings.weight")])
def test_a_tied_head_is_written_under_the_embeddings_checkpoint_name(arch: str, name: str, monkeypatch) -> None:
    """Loaders that take the embedding under its checkpoint's name only (``embedding_checkpoint_name``) take a tied
    head pushed alone too (vLLM's skip it); without that name it would be refused, not dropped."""
    from asyncllm.models.gpt2 import GPT2LMHeadModel

    runner = _runner(tiny_checkpoint(arch))
    embedding = runner.model.model.embed_tokens.weight
    head = torch.randn(embedding.shape)
    assert _push(runner, {"lm_head.weight": head}) == protocol.WeightsUpdated("t") and torch.equal(embedding, head)
    assert _push(runner, {name: -head, "lm_head.weight": -head}) == protocol.WeightsUpdated("t")
    assert torch.equal(embedding, -head)
    if arch == "gpt2":
        monkeypatch.setattr(GPT2LMHeadModel, "embedding_checkpoint_name", None)
        reply = _push(runner, {"lm_head.weight": head})
        assert isinstance(weights_error(reply), InvalidRequestError) and "not 'lm_head.weight' alone" in reply.error
        assert torch.equal(embedding, -head)


def _served(path: str) -> SimpleNamespace:
    """What `check_update` reads of a runner: the model is only built, on the meta device."""
    return SimpleNamespace(config=EngineConfig.create(path, max_model_len=256), hf_config=load_hf_config(path),
                           model=None, device=CPU, dtype=torch.float32, rank=0, tp_size=1)


def test_a_tied_head_has_the_whole_embeddings_shape_on_a_rank_holding_its_slice() -> None:
    from asyncllm.workers.pushed_weights import as_loaded
    from asyncllm.workers.weight_update import _meta_model

    runner = _served(tiny_checkpoint("gemma3"))
    runner.rank, runner.tp_size = 1, 2
    model = _meta_model(runner)
    assert model.model.embed_tokens.weight.shape == (256, 64)  # this rank's rows of 512
    head = protocol.WeightTensor("lm_head.weight", "float32", [512, 64], 0)
    assert as_loaded(model, [head]) == ([protocol.WeightTensor("model.embed_tokens.weight", "float32", [512, 64], 0)],
                                        None)


def test_a_pushed_tied_pair_is_compared_on_tensor_parallel_rank_0_only() -> None:
    """The stage's ranks map the same segment: rank 0 compares the pair, the others pass and learn the refusal from
    the all-reduce (the core answers with rank 0's reason)."""
    from asyncllm.engine.weight_tensors import pack_tensors
    from asyncllm.workers.weight_update import check_tensor_update

    head = torch.randn(512, 64)
    packed = pack_tensors({"model.embed_tokens.weight": head, "lm_head.weight": head + 1})
    command = protocol.UpdateWeights("t", "", segment=packed.segment.name, tensors=packed.tensors)
    try:
        for rank in range(2):
            runner = _served(tiny_checkpoint("gemma3"))
            runner.rank, runner.tp_size = rank, 2
            if rank == 0:
                with pytest.raises(InvalidRequestError, match="'lm_head.weight' equal to 'model.embed_tokens.weight'"):
                    check_tensor_update(runner, command)
            else:
                segment, tensors = check_tensor_update(runner, command)
                segment.close()
                assert [t.name for t in tensors] == ["model.embed_tokens.weight"]
    finally:
        packed.close()


def test_a_tied_head_is_written_into_the_embedding_on_both_pipeline_stages() -> None:
    from asyncllm.models.pipeline import PipelineStage
    from asyncllm.workers.pushed_weights import as_loaded
    from asyncllm.workers.weight_update import _meta_model

    head = protocol.WeightTensor("lm_head.weight", "float32", [512, 64], 0)
    embeddings = {"gemma3": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}  # as their loaders take it
    for arch, rank in itertools.product(embeddings, range(2)):  # the first stage holds the embedding and no head, the
        runner = _served(tiny_checkpoint(arch))                 # last its own copy and the head
        runner.stage = PipelineStage(rank, 2, rank, rank + 1)
        model = _meta_model(runner)
        tensors, _ = as_loaded(model, [head])
        assert [t.name for t in tensors] == [embeddings[arch]]
        assert model.load_weights([(t.name, torch.empty(t.shape, device="meta")) for t in tensors]) == {
            "model.embed_tokens.weight"}


def _with_tensor(served: str, folder: Path, name: str) -> str:
    """A copy of the checkpoint ``served`` with one more tensor, ``name`` (an expert's up matrix's shape)."""
    shutil.copytree(served, folder)
    [file] = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors[name] = tensors["model.layers.1.mlp.experts.0.up_proj.weight"].clone()
    save_file(tensors, file)
    return str(folder)


def test_a_checkpoint_with_more_or_other_experts_is_refused(tmp_path: Path) -> None:
    served = tiny_checkpoint("deepseek_v3")  # layer 0 dense, layer 1 eight experts
    runner = _served(served)
    more = tmp_path / "more"
    shutil.copytree(served, more)
    config = (more / "config.json").read_text()
    (more / "config.json").write_text(config.replace('"n_routed_experts": 8', '"n_routed_experts": 10'))
    with pytest.raises(InvalidRequestError, match=r"n_routed_experts=10 \(served: 8\)"):
        check_update(runner, str(more), None)
    ninth = _with_tensor(served, tmp_path / "ninth", "model.layers.1.mlp.experts.8.up_proj.weight")
    with pytest.raises(InvalidRequestError, match=r"experts.8.up_proj.weight.*ids 0..7"):
        check_update(runner, ninth, None)
    dense = _with_tensor(served, tmp_path / "dense", "model.layers.0.mlp.experts.0.up_proj.weight")
    with pytest.raises(InvalidRequestError, match=r"unexpected weights: model.layers.0.mlp.experts.0.up_proj.weight"):
        check_update(runner, dense, None)


def test_a_tied_model_is_updated_as_a_fresh_load_of_the_new_checkpoint() -> None:
    a, b = (tiny_checkpoint("llama", seed=seed, tie_word_embeddings=True) for seed in (0, 1))
    runner = _runner(a)
    model = runner.model
    assert update_weights(runner, protocol.UpdateWeights("u", b)) == protocol.WeightsUpdated("u")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one parameter: the head follows
    fresh = _params(_runner(b).model)
    got = _params(model)
    assert got.keys() == fresh.keys() and all(torch.equal(got[name], fresh[name]) for name in fresh)


def test_a_parameter_registered_twice_stays_one_on_the_meta_device() -> None:
    from asyncllm.workers.weight_update import _parameters_on_meta

    shared = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    with _parameters_on_meta():
        first, second = torch.nn.Module(), torch.nn.Module()
        first.weight, second.weight = shared, shared  # tied before either was registered
        placeholder = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        alive = weakref.ref(placeholder)
        first.bias = placeholder
        del placeholder
        assert alive() is None  # its CPU placeholder dies as the build goes on: only its meta copy is kept
    assert first.weight.is_meta and first.weight is second.weight and first.bias.is_meta


def test_a_renamed_parameter_is_pushed_under_its_own_name_and_a_fused_one_refused() -> None:
    runner = _runner(tiny_checkpoint("mixtral"), load_format="dummy")  # the checkpoint's block_sparse_moe.gate is
    router = runner.model.model.layers[0].mlp.gate.weight  # the model's mlp.gate, as transformers 5 names it
    new = torch.randn_like(router)
    unwritten = len(runner.model.checkpoint_weight_names())
    reply = _push(runner, {"model.layers.0.mlp.gate.weight": new})
    assert reply == protocol.WeightsUpdated("t", weights_unwritten=unwritten - 1)  # the checkpoint's weight written
    assert torch.equal(router, new)
    w13 = runner.model.model.layers[0].mlp.experts.w13_weight
    reply = _push(runner, {"model.layers.0.mlp.experts.w13_weight": torch.zeros_like(w13)})
    assert isinstance(weights_error(reply), InvalidRequestError) and "fuses" in reply.error, reply


def _dbrx_with(tmp_path: Path, name: str, **ffn_config) -> str:
    """A copy of the tiny DBRX checkpoint whose config.json's ``ffn_config`` has ``ffn_config``'s values."""
    folder = tmp_path / name
    shutil.copytree(tiny_checkpoint("dbrx"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["ffn_config"].update(ffn_config)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_nested_config_is_compared_in_the_keys_that_shape_the_model(tmp_path: Path) -> None:
    runner = _served(tiny_checkpoint("dbrx"))
    loss = _dbrx_with(tmp_path, "loss", moe_loss_weight=0.5, dtype="bfloat16")  # training-only, the config's dtype
    assert check_update(runner, loss, None) == loss
    with pytest.raises(InvalidRequestError, match=r"ffn_config.moe_num_experts=8 \(served: 6\)"):
        check_update(runner, _dbrx_with(tmp_path, "experts", moe_num_experts=8), None)


def test_an_error_the_loader_does_not_raise_for_a_tensor_is_refused_with_its_traceback_logged(caplog) -> None:
    from asyncllm.workers.weight_update import _loader_refusal

    with caplog.at_level(logging.WARNING, logger="asyncllm.workers.weight_update"):
        assert _loader_refusal(ValueError("its rows are 5, not 4")) == "its rows are 5, not 4"
        assert not caplog.records  # the loader's own refusal: no traceback
        try:
            raise AttributeError("'NoneType' object has no attribute 'shape'")
        except AttributeError as exc:
            assert _loader_refusal(exc) == "AttributeError: 'NoneType' object has no attribute 'shape'"
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info[0] is AttributeError


@pytest.mark.parametrize("arch", ["falcon_h1"])  # its loader scales the mixer's in_proj rows: on meta too
def test_a_path_update_loads_the_new_checkpoint_as_a_fresh_load(arch: str) -> None:
    runner = _runner(tiny_checkpoint(arch))
    new = tiny_checkpoint(arch, seed=1)
    assert update_weights(runner, protocol.UpdateWeights("u", new)) == protocol.WeightsUpdated("u")
    fresh, got = _params(_runner(new).model), _params(runner.model)
    assert got.keys() == fresh.keys() and all(torch.equal(got[name], fresh[name]) for name in fresh)


def test_an_mtp_layer_loads_from_files_unread_and_a_pushed_one_is_refused(tmp_path: Path) -> None:
    served = tiny_checkpoint("deepseek_v3")  # two layers; a real checkpoint's MTP layer is model.layers.2
    runner = _runner(served)
    mtp = "model.layers.2.mlp.down_proj.weight"
    with_mtp = _with_tensor(tiny_checkpoint("deepseek_v3", seed=1), tmp_path / "mtp", mtp)
    assert update_weights(runner, protocol.UpdateWeights("u", with_mtp)) == protocol.WeightsUpdated("u")
    fresh = _params(_runner(tiny_checkpoint("deepseek_v3", seed=1)).model)
    assert all(torch.equal(param, fresh[name]) for name, param in runner.model.named_parameters())
    for name in (mtp, "model.layers.99.mlp.down_proj.weight"):
        reply = _push(runner, {"model.norm.weight": torch.zeros(64), name: torch.ones(64, 32)})
        assert isinstance(weights_error(reply), InvalidRequestError) and f"unread '{name}'" in reply.error, reply
    assert all(torch.equal(param, fresh[name]) for name, param in runner.model.named_parameters())


@pytest.mark.parametrize("version", ["3.5", "3.5-moe"])
def test_an_image_text_qwen3_5_loads_its_mtp_layer_unread_and_a_pushed_one_is_refused(version: str,
                                                                                      tmp_path: Path) -> None:
    """Qwen3.5's releases are image-text checkpoints with a top-level ``mtp.*`` layer (an MTP draft's): served
    with images, the decoder leaves it unread as the text model does."""
    from eagle_utils import add_qwen_mtp_layer
    from qwen_vl_utils import make_tiny_qwen_vl

    plain = make_tiny_qwen_vl(tmp_path / "plain", version)
    runner = _runner(add_qwen_mtp_layer(plain, str(tmp_path / "mtp")))
    fresh = _params(_runner(plain).model)
    assert all(torch.equal(param, fresh[name]) for name, param in runner.model.named_parameters())
    reply = _push(runner, {"model.language_model.norm.weight": torch.zeros(64), "mtp.fc.weight": torch.ones(64, 128)})
    assert isinstance(weights_error(reply), InvalidRequestError) and "unread 'mtp.fc.weight'" in reply.error, reply
    assert all(torch.equal(param, fresh[name]) for name, param in runner.model.named_parameters())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "phimoe", "ernie4_5_moe", "nemotron_h", "exaone_moe"])
def test_stacked_experts_as_transformers_5_holds_them_update_as_a_fresh_load(arch: str, tmp_path: Path) -> None:
    """A transformers 5 model's ``state_dict()`` pushed, and a checkpoint of it on disk (save_pretrained writes
    the hub's per-expert names; a trainer's own save may not), write every weight as a fresh load of it."""
    from transformers import AutoModelForCausalLM

    new = tiny_checkpoint(arch, seed=1)
    state = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).state_dict()
    assert any(name.endswith(("experts.gate_up_proj", "experts.up_proj")) for name in state)  # stacked experts
    stacked = tmp_path / "stacked"
    shutil.copytree(new, stacked, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, stacked / "model.safetensors")
    fresh = _params(_runner(new).model)
    for update in (lambda r: _push(r, state), lambda r: update_weights(r, protocol.UpdateWeights("t", str(stacked)))):
        runner = _runner(tiny_checkpoint(arch), load_format="dummy")
        assert update(runner) == protocol.WeightsUpdated("t")  # every weight written
        got = _params(runner.model)
        assert got.keys() == fresh.keys() and all(torch.equal(got[name], fresh[name]) for name in fresh)


def test_a_stacked_experts_tensor_of_another_shape_in_a_file_is_a_config_error_naming_it() -> None:
    """Read from files (not pushed), a stacked tensor that is no [E, 2I, H] fails the load typed, named."""
    from asyncllm.errors import ConfigError

    model = _runner(tiny_checkpoint("qwen3_moe")).model
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(ConfigError, match=r"experts\.gate_up_proj.*got shape \[8, 65, 64\]"):
        model.load_weights([(name, torch.ones(8, 65, 64))])
