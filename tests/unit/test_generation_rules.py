"""The model's generation rules (workers/generation_rules.py) equal transformers' processors on random logits:
``suppress_tokens``, ``begin_suppress_tokens`` at the first position, and Whisper's timestamp rules after outputs of
every shape (pairs, a lone timestamp, decreasing candidates, the first token, the timestamp-probability rule both
ways); rows that do not predict timestamps get the suppression alone. The rules are read from the generation_config.json
the ``generation_config`` field names (the model folder's for ``vllm`` too), and a request predicts timestamps only when its prompt ends
with the task token."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import pytest
import torch

from asyncllm.errors import ConfigError
from asyncllm.generation_config import TimestampRules
from asyncllm.workers.generation_rules import GenerationRules, RulesStep

V, EOS, NO_TIMESTAMPS, SOT, TRANSCRIBE = 80, 40, 49, 45, 47
TB = NO_TIMESTAMPS + 1
SUPPRESS, BEGIN_SUPPRESS, MAX_INITIAL = [3, 7, 11, 30, 60], [EOS, 5, 12], 3
PROMPT = [SOT, 46, TRANSCRIBE]
OUTPUTS = [[], [], [TB], [TB + 1, 9], [TB + 1, 9, TB + 4], [TB + 1, 9, TB + 4, TB + 4], [TB, 9, 10, TB + 8, TB + 8, 20],
           [9], [9, TB + 6], [TB + 2, 9, TB + 5, 21], [TB + 3, TB + 3]]


@dataclass
class _Row:
    row: int
    token_ids: list[int]
    num_prompt_tokens: int


def _hf_processed(logits: torch.Tensor, outputs: list[int], timestamps: bool) -> torch.Tensor:
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor, WhisperTimeStampLogitsProcessor)

    config = GenerationConfig(eos_token_id=EOS, no_timestamps_token_id=NO_TIMESTAMPS,
                              max_initial_timestamp_index=MAX_INITIAL)
    processors = [SuppressTokensAtBeginLogitsProcessor(BEGIN_SUPPRESS, len(PROMPT)),
                  SuppressTokensLogitsProcessor(SUPPRESS)]
    processors += [WhisperTimeStampLogitsProcessor(config, begin_index=len(PROMPT))] if timestamps else []
    ids, scores = torch.tensor([PROMPT + outputs]), logits.unsqueeze(0)
    for processor in processors:
        scores = processor(ids, scores)
    return scores[0]


def _rules() -> GenerationRules:
    return GenerationRules(SUPPRESS, BEGIN_SUPPRESS, TimestampRules(NO_TIMESTAMPS, EOS, MAX_INITIAL,
                                                                    frozenset([TRANSCRIBE])), torch.device("cpu"))


def test_rules_equal_transformers_processors_on_random_logits():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * len(OUTPUTS), V, generator=generator) * 3
    logits[2::4, TB:] += 4.0  # timestamps likely: the probability rule bans text in some of these rows
    rules, rows = _rules(), []
    for i in range(logits.shape[0]):
        outputs, timestamps = OUTPUTS[i // 2], i % 2 == 0  # odd rows: <|notimestamps|> prompts
        prompt = PROMPT if timestamps else [SOT, 46, TRANSCRIBE, NO_TIMESTAMPS]
        rules.add(i, prompt + outputs, len(prompt))
        rows.append((_Row(i, prompt + outputs, len(prompt)), outputs, timestamps))
    step = rules.step([row for row, _, _ in rows], [len(row.token_ids) for row, _, _ in rows])
    ours = logits.clone()
    step.apply(ours)
    expected = torch.stack([_hf_processed(logits[i].clone(), outputs, timestamps) if timestamps else
                            _hf_processed_plain(logits[i].clone(), outputs)
                            for i, (_, outputs, timestamps) in enumerate(rows)])
    assert torch.equal(ours, expected)
    banned_text = torch.isinf(ours[:, :TB]).all(dim=1) & ~torch.isinf(ours[:, TB:]).all(dim=1)
    assert 0 < int(banned_text.sum()) < len(rows)  # the probability rule (or the first token's) bit some rows only


def _hf_processed_plain(logits: torch.Tensor, outputs: list[int]) -> torch.Tensor:
    """A row without timestamps: its prompt holds <|notimestamps|>, one token longer."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor)

    prompt = PROMPT + [NO_TIMESTAMPS]
    scores, ids = logits.unsqueeze(0), torch.tensor([prompt + outputs])
    for processor in (SuppressTokensAtBeginLogitsProcessor(BEGIN_SUPPRESS, len(prompt)),
                      SuppressTokensLogitsProcessor(SUPPRESS)):
        scores = processor(ids, scores)
    return scores[0]


@pytest.mark.parametrize("multilingual", [True, False])
def test_rules_read_from_generation_config(tmp_path, multilingual: bool):
    config = {"suppress_tokens": SUPPRESS, "begin_suppress_tokens": BEGIN_SUPPRESS, "eos_token_id": EOS,
              "no_timestamps_token_id": NO_TIMESTAMPS, "max_initial_timestamp_index": MAX_INITIAL,
              "is_multilingual": multilingual, "task_to_id": {"transcribe": TRANSCRIBE, "translate": 48},
              "decoder_start_token_id": SOT}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    rules = GenerationRules.of("auto", str(tmp_path), V, torch.device("cpu"))
    assert rules is not None and rules.timestamps is not None
    assert rules.timestamps.prompt_ends == ({TRANSCRIBE, 48} if multilingual else {SOT})
    for row, prompt in enumerate(([SOT, 46, TRANSCRIBE], [SOT], [SOT, 46, TRANSCRIBE, NO_TIMESTAMPS])):
        rules.add(row, prompt, len(prompt))
    assert rules.timestamp_rows == ({0} if multilingual else {1})
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "suppress_tokens": [3, "x"]}))
    with pytest.raises(ConfigError, match="suppress_tokens"):
        GenerationRules.of("auto", str(tmp_path), V, torch.device("cpu"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    assert GenerationRules.of("auto", str(tmp_path), V, torch.device("cpu")) is None


def _suppressed(rules: GenerationRules | None) -> list[int]:
    logits = torch.zeros(1, V)
    if rules is not None:
        RulesStep(rules).apply(logits)
    return torch.isinf(logits[0]).nonzero().flatten().tolist()


def test_rules_follow_the_generation_config_field(tmp_path):
    """``auto``: the model folder's file; a folder: that folder's, not the model's; ``vllm``: the model folder's (it
    drops only the sampling defaults)."""
    model, other = tmp_path / "model", tmp_path / "other"
    for folder, suppress in ((model, SUPPRESS), (other, [4, 9])):
        folder.mkdir()
        (folder / "generation_config.json").write_text(json.dumps({"suppress_tokens": suppress}))
    of = functools.partial(GenerationRules.of, model_path=str(model), vocab_size=V, device=torch.device("cpu"))
    assert _suppressed(of("auto")) == SUPPRESS
    assert _suppressed(of(str(other))) == [4, 9]
    assert _suppressed(of("vllm")) == SUPPRESS
    with pytest.raises(ConfigError, match="generation_config"):
        of(str(tmp_path))  # a folder without the file

