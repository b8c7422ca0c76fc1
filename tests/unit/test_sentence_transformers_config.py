"""A sentence-transformers checkpoint's own configs, read as vLLM reads them: ``modules.json``'s Normalize module is
embeddings' default ``normalize``, ``sentence_bert_config.json``'s ``max_seq_length`` caps ``max_model_len`` and its
``do_lower_case`` lowercases text prompts, score pairs (their token types: tests/unit/test_bert_model.py), rendered
chat and /tokenize's input; a hub snapshot fetches a Dense module's pickle beside root safetensors."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
from transformers import BatchEncoding

from asyncllm.engine.pooling_model import ClassifierHead, PoolingModel, pooling_model_of
from asyncllm.engine.prepare import _max_model_len
from asyncllm.engine.prompt_tokens import PromptTokenizer
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import ConfigError
from asyncllm.pooling import PoolingParams

_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
_POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
_NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def _folder(tmp_path, name: str, modules: list | None, encoder: dict | None = None) -> str:
    folder = tmp_path / name
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if encoder is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps(encoder))
    return str(folder)


def test_normalize_defaults_to_the_listed_normalize_module_as_vllm(tmp_path) -> None:
    config = SimpleNamespace()
    listed = _folder(tmp_path, "listed", [_TRANSFORMER, _POOLING, _NORMALIZE])
    unlisted = _folder(tmp_path, "unlisted", [_TRANSFORMER, _POOLING])
    bare = _folder(tmp_path, "bare", None)  # no modules.json: vLLM's embed default, normalized
    assert pooling_model_of("BertModel", config, listed).normalize is True
    assert pooling_model_of("BertModel", config, unlisted).normalize is False
    assert pooling_model_of("BertModel", config, bare).normalize is True
    assert pooling_model_of("BertModel", config, unlisted, {"normalize": True}).normalize is True
    assert pooling_model_of("BertModel", config, listed, {"normalize": False}).normalize is False


@pytest.mark.parametrize("file, text", [("sentence_bert_config.json", "[1]"), ("sentence_bert_config.json", "{"),
                                        ("modules.json", "{}"), ("modules.json", "[1]")])
def test_a_malformed_sentence_transformers_file_is_refused_by_name(tmp_path, file: str, text: str) -> None:
    from asyncllm.engine.pooling_model import sentence_transformers_config, sentence_transformers_normalize
    from asyncllm.models.st_dense import dense_pickle_patterns

    folder = _folder(tmp_path, "m", [_TRANSFORMER, _POOLING])
    (tmp_path / "m" / file).write_text(text)
    reads = [sentence_transformers_config] if file != "modules.json" else [sentence_transformers_normalize,
                                                                              dense_pickle_patterns]
    for read in reads:
        with pytest.raises(ConfigError, match=file):
            read(folder)


def test_max_seq_length_caps_max_model_len_and_do_lower_case_is_read(tmp_path) -> None:
    hf_config = SimpleNamespace(max_position_embeddings=64)
    path = _folder(tmp_path, "st", [_TRANSFORMER, _POOLING], {"max_seq_length": 8, "do_lower_case": True})
    config = SimpleNamespace(max_model_len=None, disable_sliding_window=False)
    assert _max_model_len(config, hf_config, path) == 8
    assert _max_model_len(config, hf_config, _folder(tmp_path, "none", None)) == 64
    assert _max_model_len(SimpleNamespace(max_model_len=6, disable_sliding_window=False), hf_config, path) == 6
    with pytest.raises(ConfigError, match=r"max_seq_length \(8\)"):  # vLLM refuses a longer one too
        _max_model_len(SimpleNamespace(max_model_len=16, disable_sliding_window=False), hf_config, path)
    assert pooling_model_of("BertModel", hf_config, path).do_lower_case is True
    assert pooling_model_of("BertModel", hf_config, _folder(tmp_path, "cased", None)).do_lower_case is False


class _Recorder:
    """A tokenizer that records what it was given: one id per character, a pair's second text token type 1."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, ...]] = []

    def __call__(self, text: str, pair: str | None = None, **_: object) -> BatchEncoding:
        self.texts.append((text,) if pair is None else (text, pair))
        types = [0] * (len(text) + 1) + [1] * (0 if pair is None else len(pair))
        return BatchEncoding({"input_ids": [ord(c) for c in text + (pair or "")] + [1], "token_type_ids": types})


@pytest.mark.parametrize("lower", [True, False])
def test_text_prompts_and_score_pairs_are_lowercased_with_do_lower_case(lower: bool) -> None:
    tokenizer = _Recorder()
    model = PoolingModel("BertForSequenceClassification", False, ClassifierHead(("LABEL_0",)), "CLS",
                         do_lower_case=lower)
    prompts = PromptTokenizer(tokenizer, 200, pooling_model=model, max_model_len=64)
    embed = SimpleNamespace(prompt="Paged ATTENTION", params=SimpleNamespace(truncate_prompt_tokens=None),
                            options=RequestOptions(pooling=PoolingParams(task="classify")))
    prompts._text_token_ids(embed)
    pair = SimpleNamespace(prompt="Ab", params=embed.params,
                           options=RequestOptions(pooling=PoolingParams(task="classify"), text_pair="CD"))
    ids = prompts._text_token_ids(pair)
    want = [("paged attention",), ("ab", "cd")] if lower else [("Paged ATTENTION",), ("Ab", "CD")]
    assert tokenizer.texts == want
    assert ids == [ord(c) for c in "".join(want[1])] + [1]
    assert pair.options.pooling.token_type_start == 3 and embed.options.pooling.token_type_start is None
    assert model.apply(pair.options.pooling).token_type_start is None  # set by tokenization only


@functools.cache
def _tiny_tokenizer():
    from asyncllm.tiny import tiny_checkpoint
    from asyncllm.tokenizer import load_tokenizer

    return load_tokenizer(tiny_checkpoint("llama"))  # case-sensitive: "Paged" and "paged" are other ids


_CASED, _MESSAGES = "Paged ATTENTION", [{"role": "user", "content": "Paged ATTENTION"}]


@pytest.mark.parametrize("lower", [True, False])
def test_chat_messages_render_to_lowercased_text_with_do_lower_case(lower: bool) -> None:
    """vLLM tokenizes the rendered chat text as a text prompt: lowercased too (the template's markup with it)."""
    from asyncllm.tokenizer import apply_chat_template

    tokenizer = _tiny_tokenizer()
    model = PoolingModel("BertModel", False, do_lower_case=lower)
    prompts = PromptTokenizer(tokenizer, len(tokenizer), pooling_model=model, max_model_len=64)
    job = SimpleNamespace(prompt=_MESSAGES, chat=True, params=SimpleNamespace(truncate_prompt_tokens=None),
                          options=RequestOptions(pooling=PoolingParams(task="embed")), mm_prompt=None)
    expected = apply_chat_template(tokenizer, [{"role": "user", "content": _CASED.lower() if lower else _CASED}])
    assert prompts._token_ids(job) == expected
    assert expected != apply_chat_template(tokenizer, [{"role": "user", "content": _CASED.swapcase()}])


@pytest.mark.parametrize("lower", [True, False])
async def test_tokenize_and_beam_search_lowercase_prompts_and_chat_with_do_lower_case(lower: bool) -> None:
    """/tokenize gives the ids the engine runs: vLLM's lowercased prompt and rendered chat (a beam search's prompt,
    tokenized by the server, too)."""
    from asyncllm.config import EngineConfig
    from asyncllm.integrations.openai_beam_search import _completion_prompt_ids
    from asyncllm.integrations.openai_server import create_app
    from asyncllm.tokenizer import apply_chat_template
    from asgi_helpers import asgi_client

    tokenizer = _tiny_tokenizer()
    engine = SimpleNamespace(started=True, tokenizer=tokenizer, metrics_registry=None,
                             config=EngineConfig.create("fake", max_model_len=64),
                             pooling_model=PoolingModel("BertModel", False, do_lower_case=lower))
    async with asgi_client(create_app(engine, model_name="fake", manage_engine=False)) as client:
        prompt = (await client.post("/tokenize", json={"prompt": _CASED})).json()["tokens"]
        chat = (await client.post("/tokenize", json={"messages": _MESSAGES})).json()["tokens"]
    text = _CASED.lower() if lower else _CASED
    assert prompt == tokenizer(text).input_ids == await _completion_prompt_ids(engine, _CASED, None, True)
    assert chat == apply_chat_template(tokenizer, [{"role": "user", "content": text}])


@pytest.mark.parametrize("dense_safetensors", [False, True])
def test_a_hub_snapshot_fetches_a_dense_modules_pickle_beside_root_safetensors(tmp_path, monkeypatch,
                                                                              dense_safetensors: bool) -> None:
    """An older sentence-transformers repo (root ``model.safetensors``, ``2_Dense/pytorch_model.bin``): the Dense
    folder's pickle is fetched too; never the root's pickles, nor a Dense pickle beside its safetensors."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from asyncllm.models.checkpoint import resolve_model_path

    dense = ["2_Dense/config.json", "2_Dense/pytorch_model.bin"] + ["2_Dense/model.safetensors"] * dense_safetensors
    repo = {"config.json": "{}", "model.safetensors": "", "pytorch_model.bin": "", "vocab.txt": "",
            "modules.json": json.dumps([_TRANSFORMER, _POOLING, {**_NORMALIZE, "idx": 3},
                                        {"idx": 2, "name": "2", "path": "2_Dense",
                                         "type": "sentence_transformers.models.Dense"}]),
            **{name: "" for name in dense}}
    snapshot = tmp_path / "snapshot"

    def snapshot_download(model, allow_patterns, **_):  # the hub's selection (huggingface_hub's own filter)
        for name in filter_repo_objects(list(repo), allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_text(repo[name])
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model_path("old-org/st-model") == str(snapshot)
    assert (snapshot / "2_Dense" / "pytorch_model.bin").exists() is not dense_safetensors
    assert not (snapshot / "pytorch_model.bin").exists()
