"""Tiny ``*ForSequenceClassification`` checkpoints (a tiny decoder with a random ``score`` head), and transformers'
classification logits, the reference the classification and scoring tests compare against."""

from __future__ import annotations

import functools
import os
import shutil


def tiny_classifier(source: str, folder: str, num_labels: int, seed: int = 0, **config: object) -> str:
    """`source`'s decoder with a seeded random score head, saved as transformers saves a classifier
    (weights ``model.*`` and ``score.weight``, architecture ``*ForSequenceClassification``)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    labels = {i: f"class_{i}" for i in range(num_labels)}
    model = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=num_labels, id2label=labels, label2id={v: k for k, v in labels.items()},
        dtype=torch.float32, **config)
    model.save_pretrained(folder)
    for name in os.listdir(source):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(os.path.join(source, name), folder)
    return folder


@functools.lru_cache(maxsize=None)
def _hf_classifier(path: str):
    import torch
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


def hf_classifier_logits(path: str, token_ids: list[int]) -> list[float]:
    """transformers' float32 logits of one prompt (batch 1, no padding: the last token's score)."""
    import torch

    with torch.no_grad():
        return _hf_classifier(path)(torch.tensor([token_ids])).logits[0].tolist()


def hf_token_classifier_logits(path: str, token_ids: list[int]) -> list[list[float]]:
    """transformers' float32 score-head logits at every position of one prompt (its classifier computes them all
    before taking the last token's)."""
    import torch

    model = _hf_classifier(path)
    with torch.no_grad():
        return model.score(model.model(torch.tensor([token_ids])).last_hidden_state)[0].tolist()


def pooling_step(path: str, task: str, prompts: dict[str, list[int]]):
    """Every prompt as one ``task`` pooling request (``classify``, ``embed``) in one prefill step of the model at
    `path`, through the real loader and `ModelRunner` (float32, CPU): each request's float32 row, and the runner."""
    import numpy as np
    import torch

    from asyncllm import PoolingParams, SamplingParams
    from asyncllm.config import EngineConfig
    from asyncllm.protocol import CachedRequestData, NewRequestData, SchedulerOutput
    from asyncllm.workers.model_runner import ModelRunner

    config = EngineConfig.create(path, max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                 device="cpu", dtype="float32")
    runner = ModelRunner(config, rank=0, tp_size=1, device=torch.device("cpu"))
    runner.load_model()
    runner.init_cache(32)
    free, params = iter(range(32)), PoolingParams(task=task)
    new = [NewRequestData(rid, prompt, len(prompt), SamplingParams(temperature=0.0, max_tokens=1),
                          [next(free) for _ in range(-(-len(prompt) // 4))], 0, pooling=params)
           for rid, prompt in prompts.items()]
    scheduled = {rid: len(prompt) for rid, prompt in prompts.items()}
    out = runner.execute_model(SchedulerOutput(0, new, CachedRequestData(), scheduled, sum(scheduled.values())))
    return {rid: np.frombuffer(out.embeddings[rid], dtype="<f4") for rid in prompts}, runner
