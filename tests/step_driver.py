"""Test helper: drive a `ModelRunner` the way the scheduler would, without one.

Requests arrive with a prompt and a max_tokens; a step prefills every newly
arrived prompt whole and decodes one token for every running request, and a
request that reached its max_tokens is sent as finished in the next step. Block
ids are handed out from a free list (freed blocks are reused), so the runner's
slot mapping and block tables are exercised the way the KV manager uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.protocol import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from asyncllm.sampling import SamplingParams


@dataclass
class DrivenRequest:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    logprobs: list[bytes] = field(default_factory=list)
    """Each step's packed logprobs rows (when the params ask for logprobs)."""
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


class StepDriver:
    def __init__(self, runner, num_blocks: int) -> None:
        self.runner = runner
        self.block_size: int = runner.block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.requests: dict[str, DrivenRequest] = {}
        self.finished: list[str] = []
        self.step_id = 0
        self.batch_sizes: list[int] = []
        """Requests per step, in order."""

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: SamplingParams) -> None:
        self.requests[req_id] = DrivenRequest(list(prompt), max_tokens, params)

    def step(self) -> ModelRunnerOutput:
        new_reqs, cached = [], CachedRequestData([], [], {})
        scheduled: dict[str, int] = {}
        for req_id, req in self.requests.items():
            if req.done:
                continue
            num = len(req.tokens) - req.computed
            new_blocks = self._allocate(req, req.computed + num)
            if not req.sent:
                req.sent = True
                new_reqs.append(NewRequestData(req_id, req.tokens, len(req.prompt), req.params, list(req.blocks), 0))
            else:
                cached.req_ids.append(req_id)
                cached.num_computed_tokens.append(req.computed)
                if new_blocks:
                    cached.new_block_ids[req_id] = new_blocks
            scheduled[req_id] = num
        sched_out = SchedulerOutput(self.step_id, new_reqs, cached, scheduled, sum(scheduled.values()),
                                    finished_req_ids=self.finished)
        self.step_id, self.finished = self.step_id + 1, []
        self.batch_sizes.append(len(scheduled))
        out = self.runner.execute_model(sched_out)
        self._apply(out, scheduled)
        return out

    def run(self) -> dict[str, DrivenRequest]:
        """Step until every request is done; returns the requests."""
        while any(not req.done for req in self.requests.values()):
            self.step()
        return self.requests

    def _apply(self, out: ModelRunnerOutput, scheduled: dict[str, int]) -> None:
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests[req_id]
            req.computed += scheduled[req_id]
            req.outputs += sampled
            if req_id in out.logprobs:
                req.logprobs.append(out.logprobs[req_id].logprobs)
            if req.done:
                self.finished.append(req_id)
                self.free_blocks.extend(reversed(req.blocks))
                req.blocks = []

    def _allocate(self, req: DrivenRequest, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(req.blocks)
        new = [self.free_blocks.pop() for _ in range(max(needed, 0))]
        req.blocks += new
        return new
