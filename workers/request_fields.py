"""One `NewRequestData` field, kept per request across steps for the requests that set it."""

from __future__ import annotations

from typing import Any

from asyncllm.protocol import SchedulerOutput

__all__ = ["RequestField"]


class RequestField(dict):
    """Request id -> its ``NewRequestData.<name>`` (requests whose field is None are not listed)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def update_states(self, sched_out: SchedulerOutput) -> None:
        """Forget finished and preempted requests (a resumed one comes back as new), learn new ones."""
        if self:
            for req_id in sched_out.finished_req_ids:
                self.pop(req_id, None)
            for req_id in sched_out.preempted_req_ids:
                self.pop(req_id, None)
        for new in sched_out.new_reqs:
            value: Any = getattr(new, self.name)
            if value is not None:
                self[new.req_id] = value
