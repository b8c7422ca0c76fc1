"""LoRA without a model run: reading PEFT adapter folders, the host's check, prefix-cache keys, max_loras scheduling."""

from __future__ import annotations

import json
import math
import os
import shutil
from types import SimpleNamespace

import pytest

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.kv.hashing import block_extra_keys, extend_block_hashes
from asyncllm.lora import read_adapter
from asyncllm.lora_checker import AdapterChecker
from asyncllm.sampling import SamplingParams
from asyncllm.sched.request import Request
from lora_utils import make_adapter
from test_scheduler import EOS, make_scheduler, run_step


@pytest.fixture(scope="module")
def adapter(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A rank-4 adapter of q, v and down (alpha 8, and 16 for v through PEFT's alpha_pattern)."""
    path = str(tmp_path_factory.mktemp("adapter"))
    return make_adapter(tiny_llama, path, seed=3, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                        alpha_pattern={"v_proj": 16})


def _copy_with_config(src: str, dst: str, **changes: object) -> str:
    shutil.copytree(src, dst)
    config_path = os.path.join(dst, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return dst


def _tiny_config(**overrides: object) -> SimpleNamespace:
    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  num_hidden_layers=2, head_dim=None)
    return SimpleNamespace(**{**fields, **overrides})


# ------------------------------------------------------------------ reading an adapter
def test_read_adapter_finds_every_module_with_its_rank_and_scaling(adapter: str) -> None:
    read = read_adapter(adapter)
    assert sorted(read.modules) == sorted(f"model.layers.{i}.{part}" for i in range(2)
                                          for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    q = read.modules["model.layers.0.self_attn.q_proj"]
    assert (q.rank, q.scaling, q.in_features, q.out_features) == (4, 8 / 4, 64, 64)
    assert read.modules["model.layers.1.self_attn.v_proj"].scaling == 16 / 4  # alpha_pattern
    assert read.modules["model.layers.1.mlp.down_proj"].in_features == 128


def test_rslora_scales_by_the_square_root_of_the_rank(adapter: str, tmp_path) -> None:
    path = _copy_with_config(adapter, str(tmp_path / "rs"), use_rslora=True)
    assert read_adapter(path).modules["model.layers.0.self_attn.q_proj"].scaling == 8 / math.sqrt(4)


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "biases"),
    ({"peft_type": "IA3"}, "IA3 adapter"),
    ({"alora_invocation_tokens": [5, 9]}, "aLoRA"),
    # PEFT's variants whose forward is not B A x over the stored matrices (their files may hold plain-shaped ones)
    ({"arrow_config": {"top_k": 2}}, "Arrow"),
    ({"use_bdlora": {"nblocks": 2, "target_modules_bd_a": ["q_proj"]}}, "BD-LoRA"),
    ({"kasa_config": {"beta": 1e-4, "gamma": 1e-3}}, "KaSA"),
    ({"use_qalora": True}, "QA-LoRA"),
    ({"lora_alpha": None}, "cannot read .*lora_alpha"),
    ({"lora_alpha": {"x": 1}}, "cannot read"),
    ({"alpha_pattern": {"q_proj(": 4}}, "cannot read"),
    ({"alpha_pattern": ["q_proj"]}, "cannot read"),
])
def test_unsupported_adapter_settings_are_named(adapter: str, tmp_path, changes: dict, message: str) -> None:
    path = _copy_with_config(adapter, str(tmp_path / "bad"), **changes)
    with pytest.raises(InvalidRequestError, match=message) as info:
        read_adapter(path)
    assert info.value.field == "lora_request"


def test_patterns_match_the_files_module_names_as_peft_does(adapter: str, tmp_path) -> None:
    """``alpha_pattern`` keys are the checkpoint's module names (GPT-2's ``c_attn``, where asyncllm says
    ``qkv_proj``): matched against the file's name, as PEFT matches them; a NaN in a matrix is refused (it would
    spread to every request batched with the adapter)."""
    import torch
    from safetensors.torch import load_file, save_file

    from asyncllm.lora import check_finite

    path = _copy_with_config(adapter, str(tmp_path / "pattern"), alpha_pattern={r"layers\.0\.self_attn\.q_proj": 40})
    read = read_adapter(path)
    assert read.modules["model.layers.0.self_attn.q_proj"].scaling == 40 / 4
    assert read.modules["model.layers.1.self_attn.q_proj"].scaling == 8 / 4
    check_finite(read)
    weights = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights)
    key = next(k for k in tensors if "lora_B" in k)
    for dtype, bad in (("float32", float("nan")), ("bfloat16", float("inf")), ("float16", -float("inf"))):
        broken = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
        broken[key][0, 0] = bad
        save_file(broken, weights)
        with pytest.raises(InvalidRequestError, match="NaN or infinity"):
            check_finite(read_adapter(path))


def test_a_folder_without_an_adapter_is_refused(tmp_path, adapter: str) -> None:
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        read_adapter(str(tmp_path))
    path = _copy_with_config(adapter, str(tmp_path / "bin"))
    os.rename(os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin"))
    with pytest.raises(InvalidRequestError, match="re-save it with safetensors"):
        read_adapter(path)


def test_tensors_other_than_projection_loras_are_refused(tmp_path, adapter: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = _copy_with_config(adapter, str(tmp_path / "extra"))
    weights = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights)
    save_file({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, weights)
    with pytest.raises(InvalidRequestError, match="not embeddings, lm_head or routers"):
        read_adapter(path)
    save_file({k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}, weights)
    with pytest.raises(InvalidRequestError, match="q_proj has lora_A without its partner"):
        read_adapter(path)


# ------------------------------------------------------------------ the host's check
def test_checker_resolves_the_folder_and_remembers_each_id(adapter: str) -> None:
    checker = AdapterChecker(_tiny_config(), max_lora_rank=8)
    checked = checker.check(LoRARequest("a", 1, os.path.relpath(adapter)))
    assert checked.lora_path == adapter and checked.lora_int_id == 1
    assert checker.check(LoRARequest("a", 1, adapter)) == checked  # the same folder by another spelling
    with pytest.raises(InvalidRequestError, match="one id, one adapter"):
        checker.check(LoRARequest("b", 1, adapter))


def test_checker_refuses_a_rank_above_max_lora_rank(adapter: str) -> None:
    with pytest.raises(InvalidRequestError, match="rank 4 is above max_lora_rank=2"):
        AdapterChecker(_tiny_config(), max_lora_rank=2).check(LoRARequest("a", 1, adapter))


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 128}, "an adapter of another model"),
    ({"num_hidden_layers": 1}, "the model has 1 layers"),
])
def test_checker_refuses_an_adapter_of_another_model(adapter: str, overrides: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        AdapterChecker(_tiny_config(**overrides), max_lora_rank=8).check(LoRARequest("a", 1, adapter))


@pytest.mark.parametrize("request_", [LoRARequest("", 1, "x"), LoRARequest("a", 0, "x"), LoRARequest("a", 1, ""),
                                      LoRARequest("a", 2**63, "x")])  # past the wire's int64
def test_lora_request_fields_are_validated(request_: LoRARequest) -> None:
    with pytest.raises(InvalidRequestError):
        request_.validate()


def test_a_missing_folder_is_the_requests_error(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="lora_path"):
        AdapterChecker(_tiny_config(), 8).check(LoRARequest("a", 1, str(tmp_path / "nowhere")))


# ------------------------------------------------------------------ prefix-cache keys
def test_the_adapter_id_keys_the_first_block_and_so_the_chain() -> None:
    assert block_extra_keys(0, None, lora_id=3) == ("lora", 3)
    assert block_extra_keys(0, "s", lora_id=3) == ("salt", "s", "lora", 3)
    assert block_extra_keys(1, "s", lora_id=3) == ()
    tokens = list(range(12))
    chains = []
    for lora_id in (0, 1, 2, 1):
        hashes: list[bytes] = []
        extend_block_hashes(hashes, tokens, 4, 3, None, lora_id=lora_id)
        chains.append(hashes)
    assert chains[1] == chains[3]
    for i in range(3):  # every block differs between adapters, not only the first
        assert len({chains[0][i], chains[1][i], chains[2][i]}) == 3


# ------------------------------------------------------------------ max_loras
def _lora_request(req_id: str, lora_id: int, prompt_len: int = 6) -> Request:
    start = 1000 * (ord(req_id[0]) - ord("a") + 1)
    lora = LoRARequest(f"l{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return Request(req_id, list(range(start, start + prompt_len)), SamplingParams(max_tokens=3), [EOS], 0.0,
                   lora=lora)


def test_max_loras_holds_a_request_whose_adapter_would_be_one_too_many() -> None:
    sched = make_scheduler(enable_lora=True, max_loras=2)
    for req_id, lora_id in [("a", 1), ("b", 2), ("c", 3), ("d", 0), ("e", 1)]:
        sched.add_request(_lora_request(req_id, lora_id))
    out, _ = run_step(sched)
    assert [n.req_id for n in out.new_reqs] == ["a", "b", "d", "e"]  # c skipped, the ones after it admitted
    assert [n.lora.lora_int_id if n.lora else 0 for n in out.new_reqs] == [1, 2, 0, 1]
    assert [r.request_id for r in sched.waiting] == ["c"]
    admitted_c = None
    for step in range(8):
        out, _ = run_step(sched)
        running = {r.lora_int_id for r in sched.running if r.lora_int_id}
        assert len(running) <= 2
        if any(n.req_id == "c" for n in out.new_reqs):
            admitted_c = step
    assert admitted_c is not None and not sched.requests  # c ran once a and b finished; all done


def test_skipped_requests_keep_their_place_in_the_queue() -> None:
    sched = make_scheduler(enable_lora=True, max_loras=1, max_num_seqs=2)
    for req_id, lora_id in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 0)]:
        sched.add_request(_lora_request(req_id, lora_id))
    out, _ = run_step(sched)
    assert [n.req_id for n in out.new_reqs] == ["a", "d"]  # max_num_seqs=2 stops the loop after d
    assert [r.request_id for r in sched.waiting] == ["b", "c", "e"]


def test_a_starved_adapter_is_admitted_once_the_running_one_drains() -> None:
    """Under steady traffic for a running adapter (1), a request for another (2) is skipped at most
    MAX_LORA_SKIPS + 1 steps: then adapter 1's new requests are held until its running ones finish; the base
    model's are admitted all along."""
    from asyncllm.sched.schedule_waiting import MAX_LORA_SKIPS

    sched = make_scheduler(enable_lora=True, max_loras=1)
    admitted: dict[str, int] = {}
    for step in range(MAX_LORA_SKIPS + 12):
        sched.add_request(_lora_request(f"a{step}", 1))  # adapter 1 arrives every step
        if step == 1:
            sched.add_request(_lora_request("b", 2))
        if step == MAX_LORA_SKIPS + 2:
            sched.add_request(_lora_request("c", 0))
        out, _ = run_step(sched)
        admitted.update((n.req_id, step) for n in out.new_reqs)
        assert len({r.lora_int_id for r in sched.running if r.lora_int_id}) <= 1
        assert not any(r.num_lora_skips for r in sched.running)  # the count restarts at each admission
    assert admitted["c"] == MAX_LORA_SKIPS + 2  # the base model is never held
    # skipped steps 1 to 17; from step 17 adapter 1's arrivals are held, its last running request ends at 18
    assert admitted["b"] == MAX_LORA_SKIPS + 3
    held = range(MAX_LORA_SKIPS + 1, admitted["b"] + 1)
    assert [admitted[f"a{step}"] for step in held] == [admitted["b"] + 3] * len(held)  # once b finished


def test_an_adapter_without_enable_lora_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="enable_lora=True") as info:
        make_scheduler().add_request(_lora_request("a", 1))
    assert info.value.field == "lora_request"


@pytest.mark.parametrize("arch", ["nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2", "falcon_h1"])
def test_the_hybrids_and_the_state_space_models_take_adapters_and_the_encoders_refuse_them(arch: str,
                                                                                          tmp_path) -> None:
    """Every hybrid takes ``enable_lora`` (on its attention and MLPs), Mamba2 too (on its mixers); an encoder
    refuses it by architecture."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import NotBuiltError
    from asyncllm.tiny import tiny_checkpoint
    from encoder_utils import make_tiny_encoder
    from mamba_utils import make_tiny_mamba

    assert prepare(EngineConfig.create(tiny_checkpoint(arch), enable_lora=True)).lora is not None
    if arch == "nemotron_h":
        mamba2 = make_tiny_mamba(tmp_path / "mamba2", "mamba2")
        assert prepare(EngineConfig.create(mamba2, enable_lora=True)).lora is not None
        with pytest.raises(NotBuiltError, match="LoRA adapters for BertModel"):
            prepare(EngineConfig.create(make_tiny_encoder(tmp_path / "bert"), enable_lora=True))


def test_an_adapter_on_a_state_layer_is_refused_by_name(tmp_path) -> None:
    """LFM2's convolution layers' projections (its attention's and MLP's take adapters: test_lora_models.py)."""
    from asyncllm.models.loader import load_hf_config
    from asyncllm.tiny import tiny_checkpoint

    path = tiny_checkpoint("lfm2")
    folder = make_adapter(path, str(tmp_path / "conv"), seed=3, rank=4, targets=r".*\.conv\.in_proj")
    with pytest.raises(InvalidRequestError, match=r"conv\.in_proj"):
        AdapterChecker(load_hf_config(path), 8).check(LoRARequest("c", 1, folder))
