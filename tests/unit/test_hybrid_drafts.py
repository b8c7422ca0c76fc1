"""Speculative decoding on the hybrids' state layers (asyncllm/models/row_states.py): a step verifying drafts keeps
each request's states after every draft, and rolling a row back to its accepted drafts leaves it as if the rejected
ones never ran: the logits of what follows equal transformers' over the true sequence (Gated DeltaNet, Mamba2,
Mamba (v1), short convolutions, Falcon-H1's both-in-a-layer, attention-free Mamba2; every draft accepted, some, none, and a request with
fewer drafts than ``num_speculative_tokens``)."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_logits
from mamba_utils import make_tiny_mamba
from model_utils import PagedRun

from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.models.row_states import RowStates
from asyncllm.tiny import tiny_checkpoint

K = 3


def _model(path: str):
    config = EngineConfig.create(path, max_num_seqs=4, speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": K})
    return load_model(config, load_hf_config(path), torch.device("cpu"), torch.float32)


def _verify(run: PagedRun, states: list[RowStates], true: list[list[int]], accepted: list[int],
            drafts: list[int]) -> None:
    """One step where each request verifies its next true token and ``drafts`` drafts: ``accepted`` true ones, then
    wrong ones; the rows rolled back and the rejected positions forgotten."""
    for i, seq in enumerate(true):
        c, k = run.num_computed[i], drafts[i]
        wrong = [(t + 7) % 500 + 6 for t in seq[c + 1 + accepted[i] : c + 1 + k]]
        run.sequences[i] = seq[: c + 1 + accepted[i]] + wrong + seq[c + 1 + k :]
        run.drafts[i] = k
    run.step([k + 1 for k in drafts])
    run.drafts.clear()
    for i, seq in enumerate(true):
        with torch.inference_mode():
            for layer in states:
                layer.rollback(run.row(i), drafts[i], accepted[i])
        run.num_computed[i] -= drafts[i] - accepted[i]
        run.logits[i][-1] = run.logits[i][-1][: 1 + accepted[i]]
        run.sequences[i] = seq


@pytest.mark.parametrize("arch", ["qwen3_5", "granitemoehybrid", "jamba", "lfm2", "falcon_h1", "mamba2"])
def test_rolled_back_states_continue_as_the_true_sequence(arch: str, tmp_path) -> None:
    path = make_tiny_mamba(tmp_path, arch) if arch == "mamba2" else tiny_checkpoint(arch)  # mamba2: no attention
    model = _model(path)
    states = [m.states for m in model.modules() if isinstance(getattr(m, "states", None), RowStates)]
    assert states and all(s.snapshots_per_row == K for s in states)
    gen = torch.Generator().manual_seed(3)
    true = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in (30, 26, 24)]
    run = PagedRun(model, [list(s) for s in true])
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    run.step([9, 6, 5])
    _verify(run, states, true, accepted=[1, K, 0], drafts=[K, K, K])
    _verify(run, states, true, accepted=[0, 2, 2], drafts=[K, K, 2])  # fewer drafts than K, all accepted
    run.step([len(s) - c for s, c in zip(true, run.num_computed)])
    for tokens, parts in zip(true, run.logits):
        torch.testing.assert_close(torch.cat(parts), hf_logits(path, tokens), atol=1e-4, rtol=0)
