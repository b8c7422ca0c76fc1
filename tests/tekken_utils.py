"""A tiny Mistral-format tokenizer (``tekken.json``) trained on the fly, and a checkpoint that ships only it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import sysconfig

NUM_SPECIAL = 100
"""Control tokens at the front of the vocabulary (real files reserve 1000)."""

PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
"""Tekken's pre-tokenizer regex (the one Mistral's files carry)."""

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
            "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]", "[THINK]",
            "[/THINK]"]
"""v13's control tokens in their ranks (v7 and v11 have a prefix of them)."""


def write_tekken(folder: str, version: str = "v13", num_merges: int = 156) -> str:
    """``folder``/tekken.json: a byte-level BPE of 256 + `num_merges` tokens trained on Python's own ``this.py``
    (with `NUM_SPECIAL` control tokens: 512 ids, the tiny checkpoints' vocabulary, by default)."""
    from tiktoken._educational import bpe_train

    with open(os.path.join(sysconfig.get_paths()["stdlib"], "this.py"), encoding="utf-8") as f:
        text = f.read() * 2
    ranks = bpe_train(text, 256 + num_merges, PATTERN, visualise=None)
    vocab = [{"rank": rank, "token_bytes": base64.b64encode(piece).decode(), "token_str": None}
             for piece, rank in sorted(ranks.items(), key=lambda item: item[1])]
    specials = [{"rank": i, "token_str": name, "is_control": True} for i, name in enumerate(SPECIALS)]
    config = {"pattern": PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": NUM_SPECIAL + len(vocab),
              "default_num_special_tokens": NUM_SPECIAL, "version": version}
    data = {"config": config,
            "vocab": vocab, "special_tokens": specials}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tekken.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    return folder


def tekken_checkpoint(tiny_llama: str, folder: str, version: str = "v13") -> str:
    """``tiny_llama``'s config and weights with only a tekken.json beside them (BOS 1, EOS 2, as Mistral's)."""
    os.makedirs(folder, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_llama, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return write_tekken(folder, version)
