"""EAGLE and EAGLE-3 heads in a runner in-process (EAGLE-3's for Qwen3-MoE and gpt-oss targets too): their drafts
equal a plain-torch reference of the head over transformers' target states, after a chunked prompt and after a
partly accepted step; the config and the host's checks refuse what does not fit, by name."""

from __future__ import annotations

import functools
import json
import shutil
from typing import Any

import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.eagle import eagle3_aux_layers
from asyncllm.models.loader import load_hf_config
from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams
from asyncllm.spec.config import SpeculativeConfig
from asyncllm.spec.draft_model import prepare_draft_model
from asyncllm.workers.model_runner import ModelRunner
from eagle_utils import (AUX_LAYERS, add_mtp_layer, add_qwen_mtp_layer, make_eagle_head, reference_drafts,
                         reference_mtp_drafts, reference_qwen_mtp_drafts)
from hf_reference import hf_greedy

K = 3
GREEDY = SamplingParams(temperature=0.0)
HEADS = {"eagle": ("eagle", {}), "hass": ("eagle", {"para_norm": True}), "eagle3": ("eagle3", {}),
         "eagle3-own-embeddings": ("eagle3", {"embeddings": True}),
         "eagle3-speculators": ("eagle3", {"speculators": True})}


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    return {name: make_eagle_head(str(root / name), tiny_llama, method, seed=i, **options)
            for i, (name, (method, options)) in enumerate(HEADS.items())}


@functools.lru_cache(maxsize=None)
def _runner(target: str, head: str, method: str, **fields: Any) -> ModelRunner:
    spec = {"method": method, "num_speculative_tokens": K, **({"model": head} if head else {})}
    config = EngineConfig.create(target, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                 speculative_config=spec, **fields)
    runner = ModelRunner(config, 0, 1, torch.device("cpu"))
    runner.load_model()
    runner.init_cache(8)
    return runner


def _step(step_id: int, new: NewRequestData | None, computed: int, num: int, new_blocks: list[int],
          drafts: list[int]) -> SchedulerOutput:
    cached = CachedRequestData() if new else CachedRequestData(["r"], [computed], {"r": new_blocks})
    return SchedulerOutput(step_id, [new] if new else [], cached, {"r": num}, num,
                           spec_token_ids={"r": drafts} if drafts else {})


@pytest.mark.parametrize("name", list(HEADS))
def test_the_heads_drafts_equal_the_reference_after_a_chunked_prompt_and_a_partly_accepted_step(
        name, heads, tiny_llama):
    method = HEADS[name][0]
    runner = _runner(tiny_llama, heads[name], method)
    assert (runner.cuda_graphs is None and runner.model.model.aux_layers == ((0, 1, 1) if method == "eagle3" else ()))
    _check_drafts(runner, tiny_llama, heads[name])


def _check_drafts(runner: ModelRunner, target: str, head: str) -> tuple[list[int], list[int]]:
    """The runner's drafts equal the reference's after a chunked prompt and after a partly accepted step; (the
    tokens after the prompt's step, its drafts)."""
    prompt = list(range(40, 64))  # 24 tokens: a chunk of 16, then 8
    want = hf_greedy(target, prompt, 3)
    new = NewRequestData("r", prompt, len(prompt), GREEDY, [3, 4], 0)
    out = runner.execute_model(_step(0, new, 0, 16, [], []))
    assert out.sampled_token_ids == [[]] and not out.draft_token_ids  # a chunk that does not sample
    out = runner.execute_model(_step(1, None, 16, 8, [], []))
    assert out.sampled_token_ids == [want[:1]]
    assert out.draft_token_ids == {"r": reference_drafts(head, target, prompt + want[:1], K)}
    first = out.draft_token_ids["r"]
    drafts = [want[1], (want[2] + 1) % 512, 0]  # the first accepted, the second not
    out = runner.execute_model(_step(2, None, 24, 1 + K, [], drafts))
    assert out.sampled_token_ids == [want[1:3]]
    assert out.draft_token_ids == {"r": reference_drafts(head, target, prompt + want[:3], K)}
    _finish(runner, 3)
    return prompt + want[:1], first


def _finish(runner: ModelRunner, step_id: int) -> None:
    runner.execute_model(SchedulerOutput(step_id, [], CachedRequestData(), {}, 0, finished_req_ids=["r"]))


def _greedy_with_drafts(runner: ModelRunner, prompt: list[int], want: list[int], n: int) -> tuple[list[int], int]:
    """At least ``n`` greedy tokens after ``prompt``, each step verifying the runner's own drafts (after an odd number
    of tokens) or ``want``'s next K tokens with the last one wrong; (the tokens, how many drafts were accepted)."""
    out = runner.execute_model(_step(0, NewRequestData("r", prompt, len(prompt), GREEDY, [3, 4, 5], 0), 0,
                                     len(prompt), [], []))
    tokens, computed, accepted = out.sampled_token_ids[0], len(prompt), 0
    while len(tokens) < n:
        i = len(tokens)
        drafts = out.draft_token_ids["r"] if i % 2 else [*want[i : i + K - 1], (want[i + K - 1] + 1) % 512]
        out = runner.execute_model(_step(i, None, computed, 1 + len(drafts), [], drafts))
        sampled = out.sampled_token_ids[0]
        tokens, computed, accepted = tokens + sampled, computed + len(sampled), accepted + len(sampled) - 1
    _finish(runner, len(tokens) + 1)
    return tokens, accepted


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_an_eagle3_head_reads_a_moe_target_s_layers_and_its_greedy_tokens_stay(arch, tmp_path_factory):
    """Qwen3-MoE's and gpt-oss's decoders keep the layers' inputs for an EAGLE-3 head (the shared layer loop): its
    drafts equal the reference's over transformers' states at those layers (not at their outputs), and greedy tokens
    verified against them equal transformers' without speculation (gpt-oss's head rotating by its target's YaRN,
    which `make_eagle_head` copies)."""
    from asyncllm.tiny import tiny_checkpoint

    target = tiny_checkpoint(arch)
    head = make_eagle_head(str(tmp_path_factory.mktemp(arch)), target, "eagle3")
    spec_dict = {"method": "eagle3", "model": head, "num_speculative_tokens": K}  # the host's check lets it through
    assert prepare_draft_model(spec_dict, SpeculativeConfig.from_dict(spec_dict), load_hf_config(target), 1, 128,
                               False)["method"] == "eagle3"
    runner = _runner(target, head, "eagle3")
    assert runner.model.model.aux_layers == tuple(AUX_LAYERS)
    tokens, drafts = _check_drafts(runner, target, head)
    assert reference_drafts(head, target, tokens, K, layers=[i + 1 for i in AUX_LAYERS]) != drafts
    prompt = list(range(100, 120))
    want = hf_greedy(target, prompt, 16 + K + 1)
    tokens, accepted = _greedy_with_drafts(runner, prompt, want, 16)
    assert tokens == want[:len(tokens)] and accepted >= K - 1


def test_an_eagle3_head_over_fewer_tokens_without_their_ids_is_refused(heads, tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    head = shutil.copytree(heads["eagle3"], tmp_path / "head")
    weights = load_file(head / "model.safetensors")
    del weights["d2t"]
    save_file(weights, head / "model.safetensors")
    with pytest.raises(ConfigError, match=r"over 128 of the 512 tokens has their ids \(d2t\)"):
        _runner.__wrapped__(tiny_llama, str(head), "eagle3")


def test_vllm_s_default_layers_and_the_method_keys():
    assert eagle3_aux_layers(object(), 32) == (2, 16, 29)
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 2})
    assert (spec.method, spec.uses_draft_model) == ("eagle3", True)
    with pytest.raises(NotBuiltError, match="quantization='fp8'"):
        SpeculativeConfig.from_dict({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
                                     "quantization": "fp8"})
    with pytest.raises(ConfigError, match="method='eagle' with 'model'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})


@pytest.mark.parametrize("method, head, change, error, words", [
    ("eagle", "eagle3", {}, ConfigError, "names LlamaForCausalLMEagle3"),
    ("eagle3", "eagle", {}, ConfigError, "a Llama-shaped eagle3 head"),
    ("eagle", "eagle", {"model_type": "llama4_text", "architectures": ["EagleLlama4ForCausalLM"]}, NotBuiltError,
     "an eagle head of architecture EagleLlama4ForCausalLM (model_type='llama4_text'"),
    ("eagle", "eagle", {"hidden_size": 32}, ConfigError, "hidden_size=64 (it reads 32)"),
    ("eagle3", "eagle3", {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, ConfigError, "three target layers in [0, 2)"),
    ("eagle3", "eagle3", {"eagle_config": {"use_aux_hidden_state": False}}, NotBuiltError, "use_aux_hidden_state"),
    ("eagle3", "eagle3", {"eagle_config": {"use_mtp_layernorm": True}}, NotBuiltError, "'use_mtp_layernorm': True"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_by_name(method, head, change, error, words, heads,
                                                                tiny_llama, monkeypatch):
    from asyncllm.spec import draft_model

    head_config = load_hf_config(heads[head])
    for key, value in change.items():
        setattr(head_config, key, value)
    monkeypatch.setattr("asyncllm.models.checkpoint.load_hf_config", lambda path: head_config)
    spec_dict = {"method": method, "model": heads[head], "num_speculative_tokens": 2}
    with pytest.raises(error, match="speculative_config") as info:
        draft_model.prepare_draft_model(spec_dict, SpeculativeConfig.from_dict(spec_dict),
                                        load_hf_config(tiny_llama), 1, 128, False)
    assert words in str(info.value)


def test_an_eagle3_head_for_a_decoder_that_keeps_no_layer_inputs_is_refused(heads, tiny_llama):
    spec_dict = {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 2}
    target = load_hf_config(tiny_llama)
    target.architectures = ["GPT2LMHeadModel"]  # Llama's stack, but its learned positions join the embeddings
    with pytest.raises(NotBuiltError, match=r"an EAGLE-3 head for a GPT2LMHeadModel target \(GPT2LMHeadModel; "
                                            r"Llama-style decoders: .*Qwen3-MoE, gpt-oss"):
        prepare_draft_model(spec_dict, SpeculativeConfig.from_dict(spec_dict), target, 1, 128, False)
    spec_dict = {**spec_dict, "method": "eagle", "model": heads["eagle"]}
    target.architectures = ["Qwen3NextForCausalLM"]  # a hybrid: it drafts with its MTP layer
    with pytest.raises(NotBuiltError, match="an eagle head for a Qwen3NextForCausalLM target"):
        prepare_draft_model(spec_dict, SpeculativeConfig.from_dict(spec_dict), target, 1, 128, False)


# ------------------------------------------------------------------ MTP layers
MTP_TARGETS = {"deepseek_v3": (add_mtp_layer, reference_mtp_drafts, "deepseek_mtp"),
               "qwen3_5": (add_qwen_mtp_layer, reference_qwen_mtp_drafts, "qwen3_5_mtp"),
               "qwen3_5_moe": (add_qwen_mtp_layer, reference_qwen_mtp_drafts, "mtp"),
               "qwen3_next": (add_qwen_mtp_layer, reference_qwen_mtp_drafts, "qwen3_next_mtp")}


@pytest.mark.parametrize("arch", list(MTP_TARGETS))
def test_the_mtp_layer_s_drafts_equal_transformers_layer_after_a_chunked_prompt_and_a_partly_accepted_step(
        arch, tmp_path):
    """DeepSeek-V3's layer (``model.layers.{L}``), Qwen3.5's and Qwen3-Next's (``mtp.``: their hybrid targets' linear
    layers rolled back to the accepted draft, so the token after the step is right too)."""
    from asyncllm.tiny import tiny_checkpoint

    add_layer, reference_drafts_of, method = MTP_TARGETS[arch]
    target = add_layer(tiny_checkpoint(arch), str(tmp_path / arch))
    runner = _runner.__wrapped__(target, "", method)
    prompt = list(range(40, 64))
    want = hf_greedy(target, prompt, 4, eos_token_id=None)
    new = NewRequestData("r", prompt, len(prompt), GREEDY, [3, 4], 0)
    assert runner.execute_model(_step(0, new, 0, 16, [], [])).sampled_token_ids == [[]]
    out = runner.execute_model(_step(1, None, 16, 8, [], []))
    assert out.sampled_token_ids == [want[:1]]
    reference = functools.partial(reference_drafts_of, target, k=K, tmp=str(tmp_path / "hf"))
    assert out.draft_token_ids == {"r": reference(prompt + want[:1])}
    drafts = [want[1], (want[2] + 1) % 512, 0]
    out = runner.execute_model(_step(2, None, 24, 1 + K, [], drafts))
    assert out.sampled_token_ids == [want[1:3]]
    assert out.draft_token_ids == {"r": reference(prompt + want[:3])}
    out = runner.execute_model(_step(3, None, 26, 1, [], []))
    assert out.sampled_token_ids == [want[3:4]]


def test_an_image_text_qwen3_5_served_as_text_drafts_with_its_mtp_layer(tmp_path):
    """Qwen3.5's releases are image-text checkpoints: served as text, their MTP layer drafts exactly as the same
    weights saved as a text checkpoint do (whose drafts equal transformers' layer: above)."""
    from safetensors.torch import load_file, save_file

    from qwen_vl_utils import make_tiny_qwen_vl

    vl = add_qwen_mtp_layer(make_tiny_qwen_vl(tmp_path / "vl0", "3.5"), str(tmp_path / "vl"))
    text = tmp_path / "text"
    text.mkdir()
    with open(f"{vl}/config.json") as f:
        cfg = json.load(f)["text_config"]
    with open(text / "config.json", "w") as f:
        json.dump({**cfg, "architectures": ["Qwen3_5ForCausalLM"], "tie_word_embeddings": False}, f)
    weights = {n.replace("model.language_model.", "model."): t for n, t in load_file(f"{vl}/model.safetensors").items()
               if not n.startswith("model.visual.")}
    save_file(weights, str(text / "model.safetensors"))
    shutil.copy(f"{vl}/mtp.safetensors", text)
    runners = [_runner.__wrapped__(vl, "", "qwen3_5_mtp", limit_mm_per_prompt={"image": 0, "video": 0}),
               _runner.__wrapped__(str(text), "", "qwen3_5_mtp")]
    prompt = list(range(40, 64))
    new = NewRequestData("r", prompt, len(prompt), GREEDY, [3, 4], 0)
    outs = [[r.execute_model(_step(0, new, 0, 24, [], [])), r.execute_model(_step(1, None, 24, 1 + K, [], [5, 6, 7]))]
            for r in runners]
    assert [(o.sampled_token_ids, o.draft_token_ids) for o in outs[0]] == \
        [(o.sampled_token_ids, o.draft_token_ids) for o in outs[1]]
    assert outs[0][0].draft_token_ids["r"]


def test_mtp_is_refused_by_name_where_the_target_has_no_layer_to_read(tiny_llama):
    spec_dict = {"method": "mtp", "num_speculative_tokens": 2}
    spec = SpeculativeConfig.from_dict(spec_dict)
    assert (spec.method, spec.model, SpeculativeConfig.from_dict({**spec_dict, "method": "deepseek_mtp"}).method) == \
        ("mtp", None, "mtp")
    with pytest.raises(ConfigError, match="unknown: model; the MTP layer is the target checkpoint's own"):
        SpeculativeConfig.from_dict({**spec_dict, "model": "x"})
    with pytest.raises(NotBuiltError, match="multi-token prediction for LlamaForCausalLM"):
        prepare_draft_model(spec_dict, spec, load_hf_config(tiny_llama), 1, 128, False)
    from asyncllm.tiny import tiny_checkpoint

    deepseek = load_hf_config(tiny_checkpoint("deepseek_v3"))
    deepseek.num_nextn_predict_layers = 2
    with pytest.raises(NotBuiltError, match="2 MTP layers"):
        prepare_draft_model(spec_dict, spec, deepseek, 1, 128, False)
    qwen = load_hf_config(tiny_checkpoint("qwen3_next"))
    qwen.mtp_num_hidden_layers, qwen.mtp_use_dedicated_embeddings = 1, True
    with pytest.raises(NotBuiltError, match="mtp_use_dedicated_embeddings"):
        prepare_draft_model(spec_dict, spec, qwen, 1, 128, False)
    without = tiny_checkpoint("deepseek_v3")  # config.json says num_nextn_predict_layers=1, its weights have none
    with pytest.raises(ConfigError, match=r"multi-token-prediction layer \(model.layers.2.\*\); this one has none"):
        _runner.__wrapped__(without, "", "mtp")


def test_a_speculators_head_without_a_method_is_read_as_eagle3(heads, tiny_llama, tmp_path):
    """RedHat's speculators format: vLLM takes the method from the head's config; a kind other than eagle3 is refused
    by name."""
    import json

    spec_dict = {"model": heads["eagle3-speculators"], "num_speculative_tokens": 2}
    resolved = prepare_draft_model(spec_dict, SpeculativeConfig.from_dict(spec_dict), load_hf_config(tiny_llama), 1,
                                   128, False)
    assert resolved["method"] == "eagle3"
    other = shutil.copytree(heads["eagle3-speculators"], tmp_path / "eagle")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "speculators_model_type": "eagle"}))
    spec_dict = {"method": "eagle", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(NotBuiltError, match="a speculators-format 'eagle' head"):
        prepare_draft_model(spec_dict, SpeculativeConfig.from_dict(spec_dict), load_hf_config(tiny_llama), 1, 128,
                            False)
