"""docs/models.md is the table asyncllm.models.catalog generates from the architecture lists."""

from __future__ import annotations

import pathlib

from asyncllm.models.architectures import SUPPORTED_ARCHITECTURES
from asyncllm.models.catalog import markdown, rows


def test_the_supported_models_doc_is_current() -> None:
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"
    assert doc.read_text(encoding="utf-8") == markdown(), "run: python -m asyncllm.models.catalog > docs/models.md"


def test_every_architecture_has_a_row_and_a_doc_that_exists() -> None:
    table = rows()
    assert [row[0] for row in table] == sorted(set(SUPPORTED_ARCHITECTURES))
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    assert all((docs / row[4]).exists() for row in table)
    by_arch = {row[0]: row for row in table}
    assert by_arch["LlamaForCausalLM"][2:4] == ("yes", "yes")  # pipeline stages and LoRA
    assert by_arch["OPTForCausalLM"][2:4] == ("yes", "yes")
    assert by_arch["GPT2LMHeadModel"][2:4] == ("yes", "yes")
    assert by_arch["FalconForCausalLM"][2:4] == ("yes", "yes")
    assert by_arch["DeepseekV3ForCausalLM"][2:4] == ("yes", "yes (experts too)")
    assert by_arch["YoutuForCausalLM"][3] == "yes"  # latent attention, dense MLPs
    assert by_arch["Gemma4ForCausalLM"][2:4] == ("yes", "yes")  # its own stage step (gemma4_stages.py)
    assert by_arch["Qwen3_5ForConditionalGeneration"][2] == "yes"  # with images: the encoder on the first stage
