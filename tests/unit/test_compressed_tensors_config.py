"""compressed-tensors ``quantization_config`` sections (asyncllm/models/compressed_tensors_config.py): the schemes
read, which module each applies to (compressed-tensors' matching rules), and every refusal, on the host
(`prequantized_config`, `prepare`) and in the workers' loader. The loaded models are in
tests/unit/test_compressed_tensors.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from compressed_tensors_reference import (
    FP8_BLOCK,
    FP8_DYNAMIC,
    FP8_STATIC,
    INT8_STATIC,
    INT8_W8A8,
    int_weights,
    write_ct_checkpoint,
)

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig, CompressedTensorsScheme
from asyncllm.models.loader import load_hf_config, load_model

LLAMA = ["LlamaForCausalLM"]
Q_PROJ = "model.layers.0.self_attn.q_proj"
DOWN_PROJ = "model.layers.1.mlp.down_proj"


def _group(fields: dict, targets: list[str] | None = None, fmt: str | None = None) -> dict:
    return {"targets": targets or ["Linear"], "weights": None, "input_activations": None, "output_activations": None,
            **fields, **({"format": fmt} if fmt else {})}


def _section(*groups: dict, fmt: str = "float-quantized", ignore: list | None = None, **top) -> dict:
    """A section as compressed-tensors 0.20's ``update_config`` writes it (fields it fills with null included)."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {f"group_{i}": group for i, group in enumerate(groups)},
            "ignore": ["lm_head"] if ignore is None else ignore, "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None, "moe_sparsity_config": None, **top}


def _hf(section: dict, arch: list[str] = LLAMA) -> SimpleNamespace:
    return SimpleNamespace(architectures=arch, quantization_config=section)


FP8_CHANNEL = CompressedTensorsScheme("fp8", "channel")
W4_G128 = CompressedTensorsScheme("int", "group", 4, 128)


# ------------------------------------------------------------------ the schemes read
@pytest.mark.parametrize("section, scheme", [
    (_section(_group(FP8_DYNAMIC)), FP8_CHANNEL),
    (_section(_group(FP8_DYNAMIC), fmt="naive-quantized"), FP8_CHANNEL),  # older FP8 checkpoints' format
    (_section(_group(FP8_STATIC)), CompressedTensorsScheme("fp8", "tensor", static_input=True)),
    (_section(_group(int_weights(4, 128)), fmt="pack-quantized"), W4_G128),
    (_section(_group(int_weights(4, 32, symmetric=False)), fmt="pack-quantized"),
     CompressedTensorsScheme("int", "group", 4, 32, symmetric=False)),
    (_section(_group(int_weights(8, None)), fmt="pack-quantized"), CompressedTensorsScheme("int", "channel", 8)),
    (_section(_group({"weights": {**int_weights(4, 128)["weights"], "actorder": "weight"}}), fmt="pack-quantized"),
     W4_G128),  # actorder 'weight' reorders during calibration only: the format is unchanged
    (_section(_group(FP8_BLOCK)), CompressedTensorsScheme("fp8", "block", block=(16, 16))),
    (_section(_group(INT8_W8A8), fmt="int-quantized"), CompressedTensorsScheme("int8", "channel")),
    (_section(_group(INT8_W8A8), fmt="naive-quantized"), CompressedTensorsScheme("int8", "channel")),  # older
    (_section(_group(INT8_STATIC), fmt="int-quantized"), CompressedTensorsScheme("int8", "tensor", static_input=True)),
], ids=["fp8-dynamic", "fp8-naive", "fp8-static", "w4a16", "w4a16-asym", "w8a16-channel", "actorder-weight",
        "fp8-block", "w8a8-int8", "w8a8-naive", "w8a8-static"])
def test_the_scheme_is_read(section: dict, scheme: CompressedTensorsScheme) -> None:
    for quantization in (None, "compressed-tensors"):
        cfg = prequantized_config(_hf(section), "m", quantization)
        assert isinstance(cfg, CompressedTensorsCheckpointConfig)
        assert cfg.scheme_of(Q_PROJ) == scheme and cfg.scheme_of("lm_head") is None and cfg.is_ignored("lm_head")
    assert EngineConfig.create("m", quantization="compressed-tensors").quantization == "compressed-tensors"


@pytest.mark.parametrize("preset, fmt, scheme", [
    ("FP8_BLOCK", "float-quantized", CompressedTensorsScheme("fp8", "block", block=(128, 128))),
    ("W8A8", "int-quantized", CompressedTensorsScheme("int8", "channel")),
    ("FP8_DYNAMIC", "float-quantized", FP8_CHANNEL),
])
def test_compressed_tensors_presets_are_read(preset: str, fmt: str, scheme: CompressedTensorsScheme) -> None:
    """compressed-tensors 0.20's own presets, as ``QuantizationScheme.model_dump`` writes them into a config."""
    from compressed_tensors.quantization import preset_name_to_scheme

    fields = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    assert prequantized_config(_hf(_section(fields, fmt=fmt)), "m", None).scheme_of(Q_PROJ) == scheme


FP8_GROUP, W4_GROUP = _group(FP8_DYNAMIC), _group(int_weights(4, 128), fmt="pack-quantized")
W8_GROUP = _group(int_weights(8, None), fmt="pack-quantized")
RULES = _section({**FP8_GROUP, "targets": ["Linear"]}, {**W4_GROUP, "targets": ["re:.*mlp\\..*_proj$"]},
                 {**W8_GROUP, "targets": [DOWN_PROJ, "re:.*mlp\\.up_proj"]},
                 ignore=["lm_head", "re:.*layers\\.0\\.mlp\\.gate_proj", "model.layers.1.self_attn.v_proj"])


def test_targets_and_ignore_follow_compressed_tensors_rules() -> None:
    """An exact name beats a regex, which beats the class ``Linear``; regexes match from the start (``re.match``);
    ``ignore`` wins over every target; a later group listing the same target replaces the earlier one's scheme."""
    fp8, w4 = FP8_GROUP, W4_GROUP
    cfg = prequantized_config(_hf(RULES), "m", None)
    w4_scheme, w8_scheme = W4_G128, CompressedTensorsScheme("int", "channel", 8)
    assert cfg.scheme_of(Q_PROJ) == FP8_CHANNEL
    assert cfg.scheme_of("model.layers.1.mlp.gate_proj") == w4_scheme  # the regex, not Linear
    assert cfg.scheme_of(DOWN_PROJ) == w8_scheme  # the exact name, not the regex
    assert cfg.scheme_of("model.layers.0.mlp.down_proj") == w4_scheme
    assert cfg.scheme_of("model.layers.0.mlp.up_proj") == w4_scheme  # re:.*mlp\..*_proj$ sorts before re:.*mlp\.up
    assert cfg.scheme_of("model.layers.0.mlp.gate_proj") is None and cfg.scheme_of("model.layers.1.self_attn.v_proj") \
        is None and cfg.scheme_of("model.layers.0.self_attn.v_proj") == FP8_CHANNEL
    only_attn = prequantized_config(_hf(_section({**fp8, "targets": ["re:.*self_attn"]}, ignore=[])), "m", None)
    assert only_attn.scheme_of(Q_PROJ) == FP8_CHANNEL and only_attn.scheme_of(DOWN_PROJ) is None
    assert only_attn.scheme_of("lm_head") is None  # not targeted, so not quantized
    overridden = prequantized_config(_hf(_section(fp8, {**w4, "targets": ["Linear"]})), "m", None)
    assert overridden.scheme_of(Q_PROJ) == w4_scheme


def test_the_schemes_are_those_compressed_tensors_attaches(tiny_llama: str) -> None:
    """compressed-tensors' own ``apply_quantization_config`` on transformers' model, with the rules above: every
    linear module gets the scheme `scheme_of` gives its name (or none)."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama))
    apply_quantization_config(model, QuantizationConfig(config_groups=RULES["config_groups"], ignore=RULES["ignore"]),
                              show_progress=False)
    cfg = prequantized_config(_hf(RULES), "m", None)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert len(linears) == 15
    for name, module in linears:
        theirs, ours = getattr(module, "quantization_scheme", None), cfg.scheme_of(name)
        assert (theirs is None) == (ours is None), name
        if ours is not None:
            args = theirs.weights
            assert (args.num_bits, args.strategy, args.group_size or -1) == (ours.bits, ours.strategy,
                                                                            ours.group_size), name


# ------------------------------------------------------------------ refusals of the section
def _fp8_with(**changes) -> dict:
    return _group({"weights": {**FP8_DYNAMIC["weights"], **changes.get("weights", {})},
                   "input_activations": changes.get("inputs", FP8_DYNAMIC["input_activations"])})


INT8_TOKEN = INT8_W8A8["input_activations"]


def _int8_with(**changes) -> dict:
    return _group({"weights": {**INT8_W8A8["weights"], **changes.get("weights", {})},
                   "input_activations": {**INT8_TOKEN, **changes.get("inputs", {})}}, fmt="int-quantized")


def _block_with(**changes) -> dict:
    return _group({"weights": {**FP8_BLOCK["weights"], **changes.get("weights", {})},
                   "input_activations": {**FP8_BLOCK["input_activations"], **changes.get("inputs", {})}})


REFUSED = {  # id: (section, architectures, error, message)
    "w8a8-asymmetric-inputs": (_section(_int8_with(inputs={"symmetric": False})), LLAMA, NotBuiltError,
                               "asymmetric int8 input_activations \\(input_zero_point"),
    "w8a8-asymmetric-weights": (_section(_int8_with(weights={"symmetric": False})), LLAMA, NotBuiltError,
                                "asymmetric or dynamic int8 W8A8 weights"),
    "w8a8-group-weights": (_section(_int8_with(weights={"strategy": "group", "group_size": 128})), LLAMA,
                           NotBuiltError, "int8 W8A8 weight strategy 'group'"),
    "w8a8-dynamic-tensor-inputs": (_section(_int8_with(inputs={"strategy": "tensor"})), LLAMA, NotBuiltError,
                                   "int8 input_activations strategy 'tensor' with dynamic True"),
    "w8a8-packed": (_section({**_int8_with(), "format": "pack-quantized"}), LLAMA, NotBuiltError,
                    "format 'pack-quantized' with int 8-bit weights and int 8-bit input_activations"),
    "w8a16-unpacked": (_section(_group(int_weights(8, None)), fmt="int-quantized"), LLAMA, NotBuiltError,
                       "format 'int-quantized' with int 8-bit weights \\(built"),
    "fp8-block-static-inputs": (_section(_block_with(inputs={"strategy": "tensor", "dynamic": False,
                                                             "group_size": None})),
                                LLAMA, NotBuiltError, "fp8 block weights \\[16, 16\\] with input_activations strategy "
                                                      "'tensor', dynamic False"),
    "fp8-block-token-inputs": (_section(_block_with(inputs={"strategy": "token", "group_size": None})), LLAMA,
                               NotBuiltError, "strategy 'token', dynamic True, group_size None \\(only dynamic 'group' "
                                              "of the block's 16 columns"),
    "fp8-block-other-group": (_section(_block_with(inputs={"group_size": 32})), LLAMA, NotBuiltError,
                              "group_size 32 \\(only dynamic 'group' of the block's 16 columns"),
    "fp8-block-malformed": (_section(_block_with(weights={"block_structure": [128]})), LLAMA, ConfigError,
                            "block_structure is two positive ints, not \\[128\\]"),
    "w4a8-int-packed": (_section(_group({**int_weights(4, 128), "input_activations": INT8_TOKEN}),
                                 fmt="pack-quantized"), LLAMA, NotBuiltError,
                        "int 8-bit input_activations with 4-bit integer weights"),
    "w4afp8": (_section(_group({**int_weights(4, 128), "input_activations": FP8_DYNAMIC["input_activations"]}),
                        fmt="pack-quantized"), LLAMA, NotBuiltError, "float 8-bit input_activations"),
    "fp8-group-weights": (_section(_fp8_with(weights={"strategy": "group", "group_size": 128})), LLAMA,
                          NotBuiltError, "fp8 weight strategy 'group' \\(only 'tensor', 'channel' and 'block'\\)"),
    "fp8-weight-only": (_section(_fp8_with(inputs=None)), LLAMA, NotBuiltError, "weight-only fp8"),
    "fp8-dynamic-tensor-inputs": (_section(_fp8_with(inputs={**FP8_DYNAMIC["input_activations"],
                                                             "strategy": "tensor"})),
                                  LLAMA, NotBuiltError, "input_activations strategy 'tensor' with dynamic True"),
    "fp8-asymmetric": (_section(_fp8_with(weights={"symmetric": False})), LLAMA, NotBuiltError, "asymmetric"),
    "nvfp4": (_section(_group({"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}), fmt="nvfp4-pack-quantized"),
              LLAMA, NotBuiltError, "format 'nvfp4-pack-quantized' with float 4-bit weights"),
    "w3a16": (_section(_group(int_weights(3, 128)), fmt="pack-quantized"), LLAMA, NotBuiltError, "int 3-bit weights"),
    "int-per-tensor": (_section(_group({"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}),
                                fmt="pack-quantized"), LLAMA, NotBuiltError, "integer weight strategy 'tensor'"),
    "actorder-group": (_section(_group({"weights": {**int_weights(4, 128)["weights"], "actorder": "group"}}),
                                fmt="pack-quantized"), LLAMA, NotBuiltError, "actorder 'group' \\(weight_g_idx\\)"),
    "dense-format": (_section(_group(FP8_DYNAMIC), fmt="dense"), LLAMA, NotBuiltError, "format 'dense'"),
    "sparse-2of4": (_section(_group(FP8_DYNAMIC), sparsity_config={"format": "sparse-24-bitmask",
                                                                   "sparsity_structure": "2:4"}),
                    LLAMA, NotBuiltError, "sparsity_config \\(format 'sparse-24-bitmask'"),
    "kv-cache-scheme-int": (_section(_group(FP8_DYNAMIC), kv_cache_scheme={"num_bits": 8, "type": "int"}),
                            LLAMA, NotBuiltError, "kv_cache_scheme"),
    "kv-cache-scheme-asymmetric": (_section(_group(FP8_DYNAMIC), kv_cache_scheme={  # zero points are not read
        "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}), LLAMA, NotBuiltError, "symmetric"),
    "transforms": (_section(_group(FP8_DYNAMIC), transform_config={"config_groups": {"u": {}}}),
                   LLAMA, NotBuiltError, "transform_config"),
    "output-activations": (_section(_group({**FP8_DYNAMIC, "output_activations": {"num_bits": 8}})),
                           LLAMA, NotBuiltError, "output_activations"),
    "activations-only": (_section(_group({"input_activations": FP8_DYNAMIC["input_activations"]})),
                         LLAMA, NotBuiltError, "without weights"),
    "embedding-target": (_section(_group(FP8_DYNAMIC, ["Linear", "Embedding"])), LLAMA, NotBuiltError,
                         "targeting 'Embedding'"),
    "attention-target": (_section(_group(FP8_DYNAMIC, ["LlamaAttention"])), LLAMA, NotBuiltError,
                         "targeting 'LlamaAttention'"),
    "lm-head": (_section(_group(FP8_DYNAMIC), ignore=[]), LLAMA, NotBuiltError, "a quantized lm_head"),
    "lm-head-regex": (_section(_group(FP8_DYNAMIC, ["re:.*lm_head"]), ignore=["re:model\\..*"]), LLAMA, NotBuiltError,
                      "a quantized lm_head"),
    "moe-fused": (_section(_group(FP8_DYNAMIC)), ["GptOssForCausalLM"], NotBuiltError, "experts are stored fused"),
    "llava": (_section(_group(FP8_DYNAMIC)), ["LlavaForConditionalGeneration"], NotBuiltError,
              "compressed-tensors LlavaForConditionalGeneration checkpoint \\(text models and the Qwen-VL decoders"),
    "qwen-vl-tower": (_section(_group(FP8_DYNAMIC)), ["Qwen2_5_VLForConditionalGeneration"], NotBuiltError,
                      "with a quantized vision tower"),
    "phi3-fused": (_section(_group(FP8_DYNAMIC)), ["Phi3ForCausalLM"], NotBuiltError, "stored fused"),
    "group-size-0": (_section(_group(int_weights(4, 128)), fmt="pack-quantized")
                     | {"config_groups": {"g": _group({"weights": {**int_weights(4, 128)["weights"],
                                                                    "group_size": 0}})}},
                     LLAMA, ConfigError, "group_size is a positive int"),
    "no-groups": (_section(), LLAMA, ConfigError, "with config_groups"),
    "ignore-not-a-list": (_section(_group(FP8_DYNAMIC), ignore="lm_head"), LLAMA, ConfigError, "ignore is a list"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_sections(case: str) -> None:
    section, arch, error, message = REFUSED[case]
    with pytest.raises(error, match=message) as info:
        prequantized_config(_hf(section, arch), "m", None)
    assert error is NotBuiltError or not isinstance(info.value, NotBuiltError)


@pytest.mark.parametrize("section, quantization, message", [
    (_section(_group(FP8_DYNAMIC)), "fp8", "None or 'compressed-tensors'"),
    (_section(_group(FP8_DYNAMIC)), "gptq", "None or 'compressed-tensors'"),
    ({"quant_method": "fp8"}, "compressed-tensors", "None or 'fp8'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "compressed-tensors", "None or one of 'awq'"),
    (None, "compressed-tensors", "this one has none"),
])
def test_quantization_must_name_the_checkpoints_method(section, quantization: str, message: str) -> None:
    hf_config = _hf(section) if section else SimpleNamespace(architectures=LLAMA)
    with pytest.raises(ConfigError, match=message) as info:
        prequantized_config(hf_config, "m", quantization)
    assert not isinstance(info.value, NotBuiltError)


# ------------------------------------------------------------------ refused on the host and in the loader
def test_an_authentic_refused_checkpoint_is_refused_before_spawning_and_in_the_loader(tiny_llama: str,
                                                                                      tmp_path) -> None:
    """A W8A8 int8 checkpoint with asymmetric activations (int8 weights per channel, int8 activations per token with a
    zero point) written by compressed-tensors (format ``int-quantized``): `prepare` on the host and `load_model` in a
    worker both refuse it."""
    path = write_ct_checkpoint(tiny_llama, tmp_path / "w8a8-asym", {
        "group_0": {**INT8_W8A8, "input_activations": {**INT8_TOKEN, "symmetric": False}}})
    hf_config = load_hf_config(str(path))
    assert hf_config.quantization_config["format"] == "int-quantized"
    message = "asymmetric int8 input_activations .* in a compressed-tensors checkpoint is not built"
    with pytest.raises(NotBuiltError, match=message):
        load_model(EngineConfig.create(str(path)), hf_config, torch.device("cpu"), torch.float32)
    from asyncllm.engine.prepare import prepare

    with pytest.raises(NotBuiltError, match=message):
        prepare(EngineConfig.create(str(path)))


def test_the_engine_never_imports_the_compressed_tensors_package() -> None:
    """A test dependency only: asyncllm reads the config and the tensors itself."""
    import ast
    from pathlib import Path

    import asyncllm.kernels
    import asyncllm.workers

    for package in (asyncllm, asyncllm.kernels, asyncllm.workers):
        for file in Path(package.__file__).parent.rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                else:
                    continue
                assert not any(name.split(".")[0] == "compressed_tensors" for name in names), (file, names)
