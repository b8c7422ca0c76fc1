"""Test helpers: tiny random HF checkpoints, paged-step drivers, a TP worker.

``save_tiny_checkpoint`` writes a float32 transformers model with random weights
(norm weights and biases randomised too, so a wrongly loaded bias or norm shows
in the logits) to a folder. ``run_paged_steps`` drives an in-house model over a
paged KV cache the way the model runner does, one flattened step at a time.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import transformers

from asyncllm.attention.metadata import AttentionMetadata

TINY_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,  # odd: the vocab-parallel split needs padding under TP
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so the scaling changes the tiny model's rotations
}

# name -> (transformers config class, model class, extra config fields)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7, "head_dim": 24}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
}


def tiny_hf_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    config_cls, _, extra = FAMILIES[family]
    fields = {**TINY_SIZES, "tie_word_embeddings": False, **extra, **overrides}
    return getattr(transformers, config_cls)(**fields)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are O(1) and every parameter matters."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith("embed_tokens.weight"):
            param.copy_(noise)
        else:
            param.copy_(0.15 * noise)


def save_tiny_checkpoint(
    path: str | os.PathLike, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> transformers.PreTrainedModel:
    """Write a tiny random float32 checkpoint of ``family`` to ``path``; returns the HF model (eval)."""
    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(config).to(torch.float32).eval()
    randomize_(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    return model


@torch.no_grad()
def hf_logits(hf_model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of one unbatched forward (no padding, no cache)."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


def make_attn_metadata(
    num_computed: list[int], num_scheduled: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """(metadata, positions) of one step: request i runs tokens ``[num_computed[i], +num_scheduled[i])``."""
    positions, slots, query_start_loc, seq_lens = [], [], [0], []
    for computed, scheduled, table in zip(num_computed, num_scheduled, block_tables):
        for pos in range(computed, computed + scheduled):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + scheduled)
        seq_lens.append(computed + scheduled)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return metadata, torch.tensor(positions, dtype=torch.int64)


@dataclass
class PagedRun:
    """A driver for some requests over one paged KV cache (blocks handed out shuffled)."""

    model: Any
    sequences: list[list[int]]
    block_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        per_req = [-(-len(seq) // self.block_size) for seq in self.sequences]
        block_ids = list(range(1, sum(per_req) + 1))  # block 0 left unused: a stray read would show
        random.Random(self.seed).shuffle(block_ids)
        self.block_tables = []
        for n in per_req:
            self.block_tables.append(block_ids[:n])
            block_ids = block_ids[n:]
        self.num_blocks = sum(per_req) + 1
        self.num_computed = [0] * len(self.sequences)
        self.logits: list[list[torch.Tensor]] = [[] for _ in self.sequences]
        self.drafts: dict[int, int] = {}
        """Request -> drafts its next step verifies (its last tokens): the state layers keep snapshots."""

    def row(self, i: int) -> int:
        return 2 * i + 1  # rows apart: a linear layer's state is per row

    def new_kv_caches(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (2, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def new_kv_caches_for(self, spec: Any, dtype: torch.dtype) -> None:
        """Caches shaped by a `KVCacheSpec` (each layer its own shape where they differ: Gemma 4), on the default
        device."""
        self.kv_caches = spec.allocate(self.num_blocks, self.block_size, dtype, torch.get_default_device())

    @torch.inference_mode()
    def step(self, num_scheduled: list[int]) -> None:
        """Run one flattened step; requests with 0 tokens sit it out."""
        reqs = [i for i, n in enumerate(num_scheduled) if n > 0]
        computed = [self.num_computed[i] for i in reqs]
        scheduled = [num_scheduled[i] for i in reqs]
        tables = [self.block_tables[i] for i in reqs]
        metadata, positions = make_attn_metadata(computed, scheduled, tables, self.block_size)
        metadata.request_rows_cpu = [self.row(i) for i in reqs]
        metadata.request_rows = torch.tensor(metadata.request_rows_cpu)
        metadata.state_drafts = [(self.row(i), self.drafts[i]) for i in reqs if i in self.drafts]
        chunks = [self.sequences[i][c : c + n] for i, c, n in zip(reqs, computed, scheduled)]
        input_ids = torch.tensor([t for chunk in chunks for t in chunk])
        logits = self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, metadata))
        for row, i in enumerate(reqs):
            start, end = metadata.query_start_loc_cpu[row], metadata.query_start_loc_cpu[row + 1]
            self.logits[i].append(logits[start:end])
            self.num_computed[i] += num_scheduled[i]

    def run(self, schedule: list[list[int]]) -> list[torch.Tensor]:
        """Run every step; returns each request's logits ``[len(seq), vocab]``."""
        for num_scheduled in schedule:
            self.step(num_scheduled)
        assert self.num_computed == [len(s) for s in self.sequences], self.num_computed
        return [torch.cat(parts) for parts in self.logits]


def assert_paged_logits_match_checkpoint(model: Any, path: str, seq_lens: list[int], schedule: list[list[int]],
                                         seed: int, atol: float = 1e-4) -> None:
    """Random sequences of ``seq_lens`` tokens (ids 6-511: a tiny checkpoint's) run over a paged cache by
    ``schedule``: every position's float32 logits equal transformers' for the checkpoint at ``path`` within
    ``atol``, with the same argmax, and transformers' logits are far from uniform (the comparison means something)."""
    from hf_reference import hf_logits as hf_path_logits

    from asyncllm.models.loader import load_hf_config
    from asyncllm.models.registry import kv_cache_spec

    spec = kv_cache_spec(load_hf_config(path), 1)
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(6, 512, (n,), generator=gen, device=gen.device).tolist() for n in seq_lens]  # the
    # generator's device, also under a caller's ``with torch.device('cuda')`` (test_gpt_oss_mxfp4_packed.py)
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    for tokens, logits in zip(sequences, run.run(schedule)):
        expected = hf_path_logits(path, tokens)
        assert expected.std() > 0.5
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def spawn_ranks(fn, args: tuple, nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn``'s ranks, forked from a server that imported torch, transformers and these
    helpers once (Python's forkserver start method) rather than each a new interpreter importing them (~4 s of CPU
    a rank); an error in a rank still propagates as its traceback. The ranks see the environment the server started
    with (this process's at the first call), not a later `monkeypatch.setenv`."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "transformers", "model_utils", "asyncllm.models.loader"])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def gloo_rank(rank: int, world_size: int, port: int, timeout_s: float) -> Iterator[None]:
    """Run the body as one rank of a spawned gloo group, then leave without a teardown.

    gloo's teardown (destroy_process_group, then its threads at interpreter exit) now
    and then aborts a rank with "terminate called without an active exception" once
    the peer has closed its sockets: a SIGABRT after the work was done and saved. So
    the ranks meet at a barrier (both finished) and leave with os._exit(0); an error
    in the body still propagates to torch.multiprocessing.spawn as a traceback.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    yield
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tp_worker(
    rank: int,
    world_size: int,
    port: int,
    paths: list[str],
    out_dir: str,
    sequences: list[list[int]],
    schedule: list[list[int]],
) -> None:
    """One TP rank (spawned): for each checkpoint, load this rank's shard, run the
    schedule and save the logits to ``out_dir/rank{rank}_{index}.pt``."""
    from asyncllm.config import EngineConfig
    from asyncllm.models.loader import load_hf_config, load_model
    from asyncllm.models.registry import kv_cache_spec

    with gloo_rank(rank, world_size, port, timeout_s=60):
        for index, path in enumerate(paths):
            hf_config = load_hf_config(path)
            config = EngineConfig.create(path)
            model = load_model(config, hf_config, torch.device("cpu"), torch.float32, rank, world_size)
            spec = kv_cache_spec(hf_config, world_size)
            run = PagedRun(model, sequences)
            run.new_kv_caches_for(spec, torch.float32)
            torch.save(run.run(schedule), os.path.join(out_dir, f"rank{rank}_{index}.pt"))


def assert_tp2_logits_match_checkpoint(path: str, out_dir: Any, seq_lens: list[int], schedule: list[list[int]],
                                       seed: int, atol: float = 1e-4) -> None:
    """Two spawned gloo ranks (`tp_worker`) run random sequences of ``seq_lens`` tokens by ``schedule``: every
    rank's float32 logits equal transformers' for the checkpoint at ``path`` within ``atol``."""
    from hf_reference import hf_logits as hf_path_logits

    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in seq_lens]
    spawn_ranks(tp_worker, (2, free_port(), [path], str(out_dir), sequences, schedule))
    for rank in range(2):
        for tokens, logits in zip(sequences, torch.load(os.path.join(str(out_dir), f"rank{rank}_0.pt")), strict=True):
            torch.testing.assert_close(logits, hf_path_logits(path, tokens), atol=atol, rtol=0)


class MaskedRun(PagedRun):
    """`PagedRun` that sets each step's LoRA mask: sequence i's tokens use slot ``slots[i]`` of ``num_slots``
    (-1: none); ``context.experts`` on, so an adapter's expert matrices count too."""

    context: Any
    slots: list[int]
    num_slots: int

    def step(self, num_scheduled: list[int]) -> None:
        token_slots = torch.tensor([s for s, n in zip(self.slots, num_scheduled) for _ in range(n)])
        self.context.set_step((token_slots[:, None] == torch.arange(self.num_slots)[None, :]).float(), experts=True)
        super().step(num_scheduled)
