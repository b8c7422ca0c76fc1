"""`RequestRows`: the counters of the running requests in arrays, so that a step's bookkeeping is vectorized.

Every step the scheduler reads and advances two counters of every running
request (`Request.num_computed_tokens`, `Request.num_tokens`). Done per request
in Python that is most of a decode step's cost; here they live in one row per
running request of two int64 arrays, and a decode step handles all of them
with a few numpy operations (asyncllm/sched/decode_step.py), leaving Python
work only for the requests that cross a KV block, stop or report more than a
token.

A request holds a row from admission (`attach`) until it leaves the running
list (`detach`: preempted, finished, aborted, requeued after a worker
restart); meanwhile its two counters are properties over the row, so code
that reads or writes them one request at a time works unchanged. A row is
taken by one request at a time: its *serial* (unique per attach) tells a
step's record whether the request it scheduled still holds the row.

The arrays are `array.array` buffers with numpy views of the same memory:
one element read through the array is a plain Python int (what the properties
return), a whole-batch operation goes through the view.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from asyncllm.sched.request import Request

__all__ = ["RequestRows", "StepRows"]


class RequestRows:
    """One row of counters and fixed facts per running request (capacity grows when needed)."""

    __slots__ = ("num_computed", "num_tokens", "computed", "tokens", "num_prompt", "delta_from", "quiet_delta_from",
                 "client", "serial", "_stop_tokens", "_stop_sets", "_clients", "_free_clients", "_free", "_next_serial")

    def __init__(self, capacity: int) -> None:
        capacity = max(capacity, 1)
        self.num_computed = array.array("q", bytes(8 * capacity))
        """Per row: `Request.num_computed_tokens` (indexing gives a Python int)."""
        self.num_tokens = array.array("q", bytes(8 * capacity))
        """Per row: `Request.num_tokens`."""
        self._make_views()
        self.num_prompt = np.zeros(capacity, np.int64)
        """Per row: the request's prompt length."""
        self.delta_from = np.zeros(capacity, np.int64)
        """Per row: a token sampled when `num_tokens + 1` reaches this needs a full delta, not just the host's token
        lists (asyncllm/sched/step_outputs.py). 0 (every token) from admission, which records an event, until the
        events are sent (`events_sent`); then `quiet_delta_from`."""
        self.quiet_delta_from = np.zeros(capacity, np.int64)
        """Per row: `delta_from` with no event to report: the length limit (prompt + max_output_tokens) where it
        may finish the request, or 0 when every output carries more than its token (logprobs, structured output)."""
        self.client = np.zeros(capacity, np.int64)
        """Per row: the host's small int (see `_clients`)."""
        self.serial = np.zeros(capacity, np.int64)
        """Per row: the serial of the request holding it; 0 when free."""
        self._stop_tokens: frozenset[int] | None = frozenset()
        """`stop_tokens`, or None until it is next read (a stop set left)."""
        self._stop_sets: dict[frozenset[int], int] = {}
        """The running requests' distinct stop sets, each with how many hold it."""
        self._clients: dict[bytes, list[int]] = {}
        """Host identity of the running requests -> [its small int (`client`), its rows], so that a step's tokens are
        grouped by host with numpy; a host leaves the map with its last row (a shared core serves hosts that come
        and go), and its int is given to the next host (`_free_clients`)."""
        self._free_clients: list[int] = []
        self._next_serial = 1
        self._free = list(range(capacity - 1, -1, -1))
        """Free rows, the lowest last (taken first)."""

    def _make_views(self) -> None:
        self.computed = np.frombuffer(self.num_computed, dtype=np.int64)
        """numpy view of `num_computed` (the same memory)."""
        self.tokens = np.frombuffer(self.num_tokens, dtype=np.int64)
        """numpy view of `num_tokens`."""

    def _grow(self) -> None:
        """Double the rows (more requests run than the capacity guessed); rows keep their numbers."""
        old = self.capacity
        for name in ("num_computed", "num_tokens"):  # a copy: the old arrays are exported to their views
            grown = array.array("q", getattr(self, name))
            grown.extend(array.array("q", bytes(8 * old)))
            setattr(self, name, grown)
        self._make_views()
        for name in ("num_prompt", "delta_from", "quiet_delta_from", "client", "serial"):
            column = getattr(self, name)
            setattr(self, name, np.concatenate([column, np.zeros_like(column)]))
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    @property
    def stop_tokens(self) -> frozenset[int]:
        """Every token that may stop a running request (the union of their `stop_check_token_ids`)."""
        if self._stop_tokens is None:
            self._stop_tokens = frozenset().union(*self._stop_sets)
        return self._stop_tokens

    @property
    def num_clients(self) -> int:
        """Hosts with running requests (1: every running request is that host's)."""
        return len(self._clients)

    @property
    def capacity(self) -> int:
        return len(self.num_computed)

    def attach(self, request: Request) -> None:
        """Give a request that starts running a row; its counters move into it."""
        assert request._rows is None, request
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.num_computed[row] = request._num_computed_tokens
        self.num_tokens[row] = request._num_tokens
        self.num_prompt[row] = request.num_prompt_tokens
        self.delta_from[row] = 0  # admission records SCHEDULED
        self.quiet_delta_from[row] = (request.num_prompt_tokens + request.max_output_tokens
                                      if request.plain_outputs else 0)
        stops = request.stop_check_token_ids
        count = self._stop_sets.get(stops, 0)
        self._stop_sets[stops] = count + 1
        if not count and self._stop_tokens is not None:
            self._stop_tokens = self._stop_tokens | stops
        client = self._clients.get(request.client_id)
        if client is None:
            number = self._free_clients.pop() if self._free_clients else len(self._clients)
            client = self._clients[request.client_id] = [number, 0]
        client[1] += 1
        self.client[row] = client[0]
        serial = self._next_serial
        self._next_serial = serial + 1
        self.serial[row] = serial
        request._row, request._rows = row, self

    def holds(self, request: Request) -> bool:
        """Whether the request holds a row here (it is running)."""
        return request._rows is self

    def events_sent(self, request: Request) -> None:
        """A running request sent its events: its next tokens may travel in the token lists."""
        self.delta_from[request._row] = self.quiet_delta_from[request._row]

    def detach(self, request: Request) -> None:
        """Take the row back from a request that stops running; its counters move back into it."""
        assert request._rows is self, request
        row = request._row
        request._num_computed_tokens = self.num_computed[row]
        request._num_tokens = self.num_tokens[row]
        request._rows = None
        self.serial[row] = 0
        stops = request.stop_check_token_ids
        count = self._stop_sets.pop(stops) - 1
        if count:
            self._stop_sets[stops] = count
        else:
            self._stop_tokens = None  # rebuilt when next read: at most once per step, however many left
        client = self._clients[request.client_id]
        client[1] -= 1
        if not client[1]:
            del self._clients[request.client_id]
            self._free_clients.append(client[0])
        self._free.append(row)

    def rows_of(self, requests: list[Request]) -> StepRows:
        """The rows and serials of these running requests, in this order."""
        rows = np.fromiter((r._row for r in requests), dtype=np.int64, count=len(requests))
        return StepRows(requests, [r.request_id for r in requests], rows, self.serial[rows])


class StepRows:
    """Running requests in one order (a step's, or the running list's) with their rows and serials then."""

    __slots__ = ("requests", "req_ids", "rows", "serials", "num_scheduled", "placeholders", "_token_lists", "_ones")

    def __init__(self, requests: list[Request], req_ids: list[str], rows: np.ndarray, serials: np.ndarray) -> None:
        self.requests = requests
        self.req_ids = req_ids
        self.rows = rows
        self.serials = serials
        self.num_scheduled: np.ndarray | None = None
        """Tokens scheduled for each (a step's record only)."""
        self.placeholders: np.ndarray | None = None
        """async_scheduling: which of them the in-flight step gave a placeholder token (asyncllm/sched/placeholders.py)."""
        self._token_lists: list[list[int]] | None = None
        self._ones: dict[str, int] | None = None

    @property
    def token_lists(self) -> list[list[int]]:
        """Their `all_token_ids` lists (each request keeps its list object for life)."""
        if self._token_lists is None:
            self._token_lists = [r.all_token_ids for r in self.requests]
        return self._token_lists

    def one_token_each(self) -> dict[str, int]:
        """A new ``{request_id: 1}`` dict of them (a copy of one built once)."""
        if self._ones is None:
            self._ones = dict.fromkeys(self.req_ids, 1)
        return self._ones.copy()

    def __len__(self) -> int:
        return len(self.requests)

    def live(self, rows: RequestRows) -> np.ndarray:
        """Which of them still hold their rows (have not stopped running since)."""
        return rows.serial[self.rows] == self.serials
