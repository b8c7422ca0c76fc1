"""Train the bundled tiny Llama on the Python standard library's own source.

``python -m asyncllm.tiny_train --out asyncllm/data/tiny-llama`` rebuilds the
model that asyncllm ships (and uses when no model is given) from nothing but
this machine's Python installation: the corpus is the standard library's
``.py`` files (PSF license, always available offline), the tokenizer is the
byte-level BPE of `asyncllm.tiny` trained on the training split, the model is a
plain `LlamaForCausalLM`. The recipe is sized for a 2-core CPU and about 25
minutes; docs/tiny-model.md reports what the shipped run measured.

The split is by file (a hash of the relative path), so held-out perplexity is
measured on modules the model never saw, not on other windows of the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["TrainRecipe", "corpus_files", "split_corpus", "train"]

_SKIP_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"})
"""Folders left out: third-party code, test suites, and generated tables (codecs, pydoc topics)."""

_MAX_FILE_BYTES = 400_000
"""Bigger files are generated data (unicode tables), not source a person writes."""


@dataclass(frozen=True)
class TrainRecipe:
    """Every knob of a training run; the shipped run used these defaults."""

    vocab_size: int = 4096
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 512
    seq_len: int = 512
    """Training context; also the model's max_position_embeddings (RoPE is not trained beyond it)."""
    batch_size: int = 4
    steps: int = 800
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    heldout_every: int = 20
    """One file in this many (by path hash) is held out."""
    eval_every: int = 100
    eval_windows: int = 32
    """Held-out windows scored at each periodic eval (the final eval scores all of them)."""
    seed: int = 0
    threads: int = 1
    """torch threads; 1 stays efficient when other processes share the cores (2 are faster on an idle machine)."""


def corpus_files(stdlib: Path | None = None) -> list[tuple[str, str]]:
    """``(relative path, text)`` of every standard-library source file we train on, sorted by path."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            out.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately mis-encoded
    return out


def split_corpus(files: list[tuple[str, str]], heldout_every: int) -> tuple[list[str], list[str]]:
    """Split by file: a path whose sha256 is 0 modulo ``heldout_every`` is held out."""
    train_texts: list[str] = []
    heldout_texts: list[str] = []
    for rel, text in files:
        bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % heldout_every
        (heldout_texts if bucket == 0 else train_texts).append(text)
    return train_texts, heldout_texts


def _token_stream(tokenizer: Any, texts: list[str]) -> Any:
    """All documents as one id tensor: ``<|bos|> doc <|eos|>`` back to back."""
    import torch

    ids: list[int] = []
    for encoded in tokenizer(texts).input_ids:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _build_model(recipe: TrainRecipe, tokenizer: Any) -> Any:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads, intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.seq_len, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    return model


def _lr_at(step: int, recipe: TrainRecipe) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _loss(model: Any, windows: Any) -> Any:
    import torch.nn.functional as F

    logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1))


def heldout_perplexity(model: Any, stream: Any, seq_len: int, max_windows: int | None = None) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping windows of the held-out stream."""
    import torch

    count = (len(stream) - 1) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    total, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, count, 16):
            rows = range(start, min(count, start + 16))
            windows = torch.stack([stream[r * seq_len: r * seq_len + seq_len + 1] for r in rows])
            total += _loss(model, windows).item() * len(rows) * seq_len
            n += len(rows) * seq_len
    model.train()
    return math.exp(total / n)


def train(recipe: TrainRecipe, out: Path, log: Any = print) -> dict[str, Any]:
    """Run the recipe and write the checkpoint (bf16 safetensors, tokenizer, ``training.json``) to ``out``."""
    import torch

    from asyncllm.tiny import _build_tokenizer, _pin_no_unk_token

    torch.set_num_threads(recipe.threads)
    started = time.monotonic()
    train_texts, heldout_texts = split_corpus(corpus_files(), recipe.heldout_every)
    tokenizer = _build_tokenizer(recipe.vocab_size, recipe.seq_len, corpus=train_texts)
    train_ids, heldout_ids = _token_stream(tokenizer, train_texts), _token_stream(tokenizer, heldout_texts)
    log(f"corpus: {len(train_texts)} train files ({len(train_ids)} tokens), "
        f"{len(heldout_texts)} held-out files ({len(heldout_ids)} tokens)")
    model = _build_model(recipe, tokenizer)
    log(f"model: {sum(p.numel() for p in model.parameters())} parameters")
    history = _train_loop(model, recipe, train_ids, heldout_ids, log)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.eval()
    final_ppl = heldout_perplexity(model.float(), heldout_ids, recipe.seq_len)
    log(f"final held-out perplexity (all windows, bf16 weights): {final_ppl:.2f}")
    report = {
        "recipe": asdict(recipe), "train_files": len(train_texts), "heldout_files": len(heldout_texts),
        "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids),
        "parameters": sum(p.numel() for p in model.parameters()), "history": history,
        "heldout_perplexity": round(final_ppl, 3), "wall_clock_s": round(time.monotonic() - started, 1),
        "torch": torch.__version__,
    }
    _save(model, tokenizer, out, report)
    _pin_no_unk_token(out / "tokenizer_config.json")
    return report


def _train_loop(model: Any, recipe: TrainRecipe, train_ids: Any, heldout_ids: Any, log: Any) -> list[dict[str, Any]]:
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(recipe.seed)
    history: list[dict[str, Any]] = []
    tic, running = time.monotonic(), 0.0
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, recipe)
        starts = torch.randint(0, len(train_ids) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        windows = torch.stack([train_ids[s: s + recipe.seq_len + 1] for s in starts.tolist()])
        loss = _loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % 25 == 0:
            rate = 25 * recipe.batch_size * recipe.seq_len / (time.monotonic() - tic)
            log(f"step {step + 1}/{recipe.steps} loss {running / 25:.3f} lr {_lr_at(step, recipe):.2e} {rate:.0f} tok/s")
            tic, running = time.monotonic(), 0.0
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            ppl = heldout_perplexity(model, heldout_ids, recipe.seq_len, recipe.eval_windows)
            history.append({"step": step + 1, "train_loss": round(loss.item(), 4), "heldout_ppl": round(ppl, 3)})
            log(f"eval step {step + 1}: held-out perplexity {ppl:.2f} (first {recipe.eval_windows} windows)")
    return history


def _save(model: Any, tokenizer: Any, out: Path, report: dict[str, Any]) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report["sample"] = _sample(model.float(), tokenizer)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _sample(model: Any, tokenizer: Any, prompt: str = "def fibonacci(n):") -> str:
    """Greedy continuation for the report (transformers' generate, as a reference)."""
    import torch

    ids = torch.tensor([tokenizer(prompt).input_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=96, do_sample=False)
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m asyncllm.tiny_train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint to")
    for field in fields(TrainRecipe):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    recipe = TrainRecipe(**{f.name: getattr(args, f.name) for f in fields(TrainRecipe)})
    report = train(recipe, args.out, log=lambda line: print(line, flush=True))
    print(f"wrote {args.out} (held-out perplexity {report['heldout_perplexity']})")


if __name__ == "__main__":
    main()
