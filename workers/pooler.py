"""The model runner's embedding hook: the embedding requests, and their embeddings from a step's hidden states.

An embedding request (`asyncllm.pooling`) samples one token like any other;
the step that samples it (its prompt's last token computed) also returns its
embedding, truncated to ``dimensions`` and L2-normalized as asked, in float32:
the final hidden state of that last token (LAST pooling), or, for MEAN and CLS
pooling, the float32 sum of every prompt row divided by their count, or the
first prompt row, gathered by `Pooler.observe` over the request's chunks (the
scheduler gives these requests no prefix-cache hits, so every prompt row is
computed here; docs/embeddings.md), then through the checkpoint's
sentence-transformers Dense modules where it has them. A classification request
(``task="classify"``) gets the model's ``score`` head applied to the last row
instead: its logits, in float32 (asyncllm/models/classifier.py). A per-token
request (``task="token_embed"``, ALL pooling) keeps every prompt row of its
chunks and returns them all, each projected, truncated and normalized as an
embedding is: ``prompt_len * dimensions`` float32s, in prompt order
(``token_classify``: each row through the score head, or the model's ``token_classify`` head where it has one: the
encoders', ``prompt_len * num_labels``; on a reward model,
``convert="reward"``, the rows themselves, STEP's rows and columns, through the activation: `Pooler._reward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncllm.pooling import PoolingParams
from asyncllm.protocol import SchedulerOutput
from asyncllm.workers.request_fields import RequestField

__all__ = ["Pooler"]


class Pooler:
    """Which requests of this rank want an embedding."""

    def __init__(self) -> None:
        self.requests: RequestField = RequestField("pooling")
        """Request id -> its `PoolingParams` (embedding and classification requests only)."""
        self.classifier: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The model's ``classify`` (hidden -> float32 logits) when it has a score head, set with the model."""
        self.projection: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The checkpoint's sentence-transformers Dense modules (asyncllm/models/st_dense.py), applied to each pooled
        embedding before ``dimensions`` and the norm; None without any."""
        self.pooled: dict[str, tuple[torch.Tensor, int]] = {}
        """MEAN / CLS requests: the float32 sum of their prompt rows so far (CLS: the first row) and the row count."""
        self.rows: dict[str, list[torch.Tensor]] = {}
        """ALL (``token_embed``, ``token_classify``) and STEP (a reward model's) requests: their prompt rows so far, one
        tensor per chunk."""
        self.step_tokens: dict[str, list[int]] = {}
        """A reward model's STEP requests with a ``step_tag_id``: their prompt's token ids (which rows to keep)."""

    def update_states(self, sched_out: SchedulerOutput) -> None:
        self.requests.update_states(sched_out)
        for req_id in sched_out.finished_req_ids:
            self.pooled.pop(req_id, None)
            self.rows.pop(req_id, None)
            self.step_tokens.pop(req_id, None)
        for new in sched_out.new_reqs:  # (re)started from its first token: recomputes every row
            if new.pooling is not None and new.pooling.step_tag_id is not None:
                self.step_tokens[new.req_id] = list(new.token_ids)
            if new.num_computed_tokens == 0:
                self.pooled.pop(new.req_id, None)
                self.rows.pop(new.req_id, None)

    @property
    def pools_all(self) -> bool:
        """Whether a request of this rank pools more than its last row."""
        return any(params.pooling_type != "LAST" for params in self.requests.values())

    def observe(self, req_ids: list[str], query_start_loc: list[int], hidden: torch.Tensor) -> None:
        """Add this step's rows of the MEAN / CLS / ALL requests (request i owns rows ``query_start_loc[i:i+2]``)."""
        for i, req_id in enumerate(req_ids):
            params = self.requests.get(req_id)
            if params is None or params.pooling_type == "LAST":
                continue
            rows = hidden[query_start_loc[i] : query_start_loc[i + 1]]
            if params.pooling_type in ("ALL", "STEP"):  # a copy (the step's buffer may be reused), in the model dtype
                self.rows.setdefault(req_id, []).append(rows.clone())
                continue
            rows = rows.float()
            total, count = self.pooled.get(req_id, (None, 0))
            if params.pooling_type == "CLS":
                if total is None:
                    self.pooled[req_id] = (rows[0].clone(), 1)
                continue
            step_sum = rows.sum(dim=0)
            self.pooled[req_id] = (step_sum if total is None else total + step_sum, count + rows.shape[0])

    def token_type_starts(self, req_ids: list[str]) -> list[int | None] | None:
        """Where each of the step's requests turns to token type 1 (a score pair's second text), None for the
        others; None when no request of the step has one (every token type 0)."""
        starts = [getattr(self.requests.get(req_id), "token_type_start", None) for req_id in req_ids]
        return starts if any(start is not None for start in starts) else None

    def samples_any(self, req_ids: list[str], sample_indices: list[int]) -> bool:
        """Whether an embedding request samples this step (its embedding goes out with the step's output)."""
        return bool(self.requests) and any(req_ids[i] in self.requests for i in sample_indices)

    def embeddings(self, req_ids: list[str], sample_indices: list[int], selected: torch.Tensor) -> dict[str, bytes]:
        """The embeddings of the step's sampling embedding requests; ``selected`` holds one hidden row per
        sampling request, in ``sample_indices`` order."""
        out = {}
        for row, index in enumerate(sample_indices):
            req_id = req_ids[index]
            params = self.requests.get(req_id)
            if params is None:
                continue
            hidden = selected[row]
            if params.pooling_type in ("ALL", "STEP"):  # token_embed / token_classify: every prompt row, one each
                hidden = torch.cat(self.rows.pop(req_id))
            elif params.pooling_type != "LAST":  # MEAN / CLS embeddings; an encoder classifier's CLS row
                total, count = self.pooled.pop(req_id)
                hidden = total / count
            if params.pooling_type == "STEP":  # a reward model's rows: through its head where it has one
                rows = hidden if self.classifier is None else self.classifier(hidden)
                pooled = self._reward(params, rows, self.step_tokens.pop(req_id, None))
            else:
                pooled = self._pool(params, hidden)
            out[req_id] = pooled.cpu().numpy().astype("<f4").tobytes()
        return out

    @staticmethod
    def _reward(params: PoolingParams, hidden: torch.Tensor, tokens: list[int] | None) -> torch.Tensor:
        """A reward model's rows (vLLM's StepPooler; ALL without ``step_tag_id`` and ``returned_token_ids``): every
        prompt row (as_reward_model's hidden state, or a reward head's logits) in float32, the columns
        ``returned_token_ids`` and the rows of the ``step_tag_id`` tokens, then the activation (softmax over each
        row, sigmoid for one column) unless ``use_activation`` is False."""
        scores = hidden.float()
        if params.returned_token_ids:
            scores = scores[:, list(params.returned_token_ids)]
        if params.step_tag_id is not None and tokens is not None:
            ids = torch.tensor(tokens[: scores.shape[0]], device=scores.device)
            scores = scores[ids == params.step_tag_id]
        if params.use_activation is False:
            return scores
        return torch.sigmoid(scores) if scores.shape[-1] < 2 else torch.softmax(scores, dim=-1)

    def _pool(self, params: PoolingParams, hidden: torch.Tensor) -> torch.Tensor:
        if params.task in ("classify", "token_classify"):
            assert self.classifier is not None, "the host sends classification requests to classifiers only"
            if params.task == "token_classify":  # an encoder's per-row head where it has one (asyncllm/models/bert.py)
                return getattr(getattr(self.classifier, "__self__", None), "token_classify", self.classifier)(hidden)
            return self.classifier(hidden)
        if self.projection is not None:
            hidden = self.projection(hidden.to(next(self.projection.parameters()).dtype))  # type: ignore[attr-defined]
        vector = hidden[..., : params.dimensions].float()  # one row, or ALL pooling's row per token
        return F.normalize(vector, dim=-1) if params.normalize is not False else vector
