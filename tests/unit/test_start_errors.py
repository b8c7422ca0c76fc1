"""What a user sees when a checkpoint cannot be read at start: one typed error, one line (the CLI prints it as its
single `asyncllm: error:` line), naming the cause."""
import json
import os
import shutil

import pytest

from asyncllm.bundled import bundled_model_path
from asyncllm.errors import ConfigError
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.tokenizer import load_tokenizer


def _copy(tmp_path, **config_fields) -> str:
    """The bundled tiny model copied into `tmp_path`, its config.json's `config_fields` changed."""
    folder = str(tmp_path / "model")
    shutil.copytree(bundled_model_path(), folder)
    if config_fields:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump({**config, **config_fields}, f)
    return folder


def test_a_folder_without_tokenizer_files_is_one_line_naming_the_tokenizer(tmp_path):
    folder = _copy(tmp_path)
    os.remove(os.path.join(folder, "tokenizer.json"))
    os.remove(os.path.join(folder, "tokenizer_config.json"))
    with pytest.raises(ConfigError) as info:
        load_tokenizer(folder)
    assert info.value.field == "tokenizer"
    assert "\n" not in str(info.value)  # transformers' text has five lines; the CLI promises one
    assert "Couldn't instantiate the backend tokenizer" in str(info.value)


def test_an_unknown_model_type_is_one_line_naming_it(tmp_path):
    folder = _copy(tmp_path, model_type="foobarxyz")
    with pytest.raises(ConfigError) as info:
        load_hf_config(folder)
    assert "\n" not in str(info.value)
    assert "foobarxyz" in str(info.value)


def test_remote_code_needing_a_missing_package_is_a_config_error_naming_it(tmp_path):
    folder = _copy(tmp_path, auto_map={"AutoConfig": "configuration_x.XConfig"}, model_type="xmodel")
    with open(os.path.join(folder, "configuration_x.py"), "w") as f:
        f.write("import not_a_real_module_xyz\n")
    with pytest.raises(ConfigError) as info:  # was transformers' ImportError, a traceback from `asyncllm serve`
        load_hf_config(folder, trust_remote_code=True)
    assert "not_a_real_module_xyz" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "glm4"])
def test_float16_asked_for_a_family_unstable_in_it_is_refused_as_vllm_refuses_it(model_type):
    import torch
    from types import SimpleNamespace

    from asyncllm.models.loader import resolve_dtype

    config = SimpleNamespace(model_type=model_type, dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as info:  # vLLM: "The model type 'gemma2' does not support float16"
        resolve_dtype("float16", config, torch.device("cpu"))
    assert info.value.field == "dtype" and model_type in str(info.value)
    assert resolve_dtype("bfloat16", config, torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float16", SimpleNamespace(model_type="llama"), torch.device("cpu")) == torch.float16


def test_a_config_json_holding_null_is_a_config_error(tmp_path):
    folder = _copy(tmp_path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("null")
    with pytest.raises(ConfigError) as info:  # was transformers' TypeError, a traceback from the CLI
        load_hf_config(folder)
    assert info.value.field == "model"


def test_architectures_given_as_a_string_is_named_not_its_first_letter(tmp_path):
    from asyncllm.models.architectures import architecture_of

    folder = _copy(tmp_path, architectures="LlamaForCausalLM")
    with pytest.raises(ConfigError) as info:  # was NotBuiltError: "the L architecture"
        architecture_of(load_hf_config(folder))
    assert "'LlamaForCausalLM'" in str(info.value) and "the L architecture" not in str(info.value)


def test_a_pytorch_bin_that_is_no_checkpoint_is_one_line(tmp_path):
    from asyncllm.models.pt_checkpoint import iterate_pt

    file = str(tmp_path / "pytorch_model.bin")
    with open(file, "w") as f:
        f.write("garbage\n")
    with pytest.raises(ConfigError) as info:
        list(iterate_pt([file]))
    assert "UnpicklingError" in str(info.value) and "\n" not in str(info.value)  # torch's text has six lines


def test_a_hub_refusal_is_one_line_naming_the_id(monkeypatch):
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    from asyncllm.models import hub

    def refuse(*args, **kwargs):
        raise RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found for url: https://huggingface.co/x.\n"
                                      "Please make sure you specified the correct `repo_id` and `repo_type`.",
                                      response=httpx.Response(404, request=httpx.Request("GET", "https://hf.co/x")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(hub, "hub_unanswered", lambda *args: None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ConfigError) as info:
        hub.resolve_model_path("myorg/absent")
    assert "myorg/absent" in str(info.value) and "Repository Not Found" in str(info.value)
    assert "\n" not in str(info.value)
