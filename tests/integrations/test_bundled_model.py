"""The bundled tiny model: shipped whole and small, the default model, and token-exact against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.bundled import bundled_model_path
from hf_reference import hf_greedy

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_files_and_size() -> None:
    folder = Path(bundled_model_path())
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "training.json"} <= names
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 25 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_documented_perplexity_is_the_measured_one() -> None:
    report = json.loads((Path(bundled_model_path()) / "training.json").read_text())
    doc = (ROOT / "docs" / "tiny-model.md").read_text(encoding="utf-8")
    assert f"{report['heldout_perplexity']:.2f}" in doc
    assert report["heldout_files"] > 0 and report["train_files"] > 10 * report["heldout_files"]


def test_it_is_the_default_model() -> None:
    assert AsyncEngine().config.model == bundled_model_path()
    assert AsyncEngine(None, max_num_seqs=2).config.max_num_seqs == 2


@pytest.mark.asyncio(loop_scope="session")
async def test_greedy_matches_transformers(bundled_engine, bundled_tokenizer) -> None:
    prompt = "def read_config(path):\n"
    out = await bundled_engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert out.token_ids == hf_greedy(bundled_model_path(), bundled_tokenizer(prompt).input_ids, 24)


@pytest.mark.asyncio(loop_scope="session")
async def test_chat_template(bundled_engine, bundled_tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    rendered = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|bos|><|user|>hi<|eos|><|assistant|>"
    deltas = [d async for d in bundled_engine.chat(messages, SamplingParams(temperature=0, max_tokens=4))]
    assert deltas[-1].finish_reason in ("stop", "length")
