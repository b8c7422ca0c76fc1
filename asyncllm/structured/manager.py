"""`StructuredOutputManager`: the core's side of structured output (docs/sampling.md#structured-output).

1. `add` parks a request whose `params.structured` is set until its grammar
   compiles (`GrammarCompilerPool`, off the step loop); `poll` hands the
   ready ones to the scheduler and fails the broken or timed-out ones with an
   error delta. A parked request holds no KV block and is never scheduled;
   the other requests keep running.
2. `grammar_bitmask` fills one xgrammar token-bitmask row per structured
   request that samples in this step (a drafted request: one per position the
   grammar constrains, the matcher stepping through its drafts and rolled
   back after); it rides to the workers on the `SchedulerOutput`, where
   `apply_grammar_bitmask` masks the logits.
3. `accept` advances each matcher with the sampled tokens and finishes a
   request with finish_reason "stop" when its grammar has ended (or may end
   where allowed_token_ids or bad_words forbade EOS: `narrowing.stop_before`).

A constraint with `start_after_token_ids` (a reasoning model's ``</think>``)
waits: no bitmask row and no matcher step until the output has written them
(`Marker.ends`: with a suffix, gpt-oss's ``<|channel|>final`` then ``<|message|>``
with a few tokens between); the tokens after them are the grammar's. One whose
marker has an opener (`StructuredOutputs.start_after_only_if_reply_opens`,
mistral's ``[THINK]``) is undecided until its first token: that one's row is the
grammar's with the opener allowed too; the opener then waits, any other token is
the grammar's first. With `Marker.after_space` (glm45's, GLM-4.5 writes ``\n<think>``)
whitespace tokens are allowed too and keep it undecided, free, not the grammar's.

Nothing here runs when no request is structured: the core checks `active` first.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from asyncllm import protocol
from asyncllm.errors import InvalidRequestError
from asyncllm.sched.request import Request
from asyncllm.structured.compiler import GrammarCompilerPool, check_xgrammar_installed
from asyncllm.structured.narrowing import may_end, narrowing, rejection, stop_before
from asyncllm.structured.start_after import Marker

__all__ = ["StructuredOutputManager"]

logger = logging.getLogger("asyncllm.structured")


class _Pending:
    __slots__ = ("request", "future", "submitted_at", "compiling_since")

    def __init__(self, request: Request, future: Future[Any], submitted_at: float) -> None:
        self.request = request
        self.future = future
        self.submitted_at = submitted_at
        self.compiling_since: float | None = None
        """When a poll first saw a compile thread on its grammar (None: queued behind others' grammars)."""


class StructuredOutputManager:
    """Grammar compilation, per-step bitmasks and matchers of the structured requests."""

    def __init__(self, tokenizer_path: str, vocab_size: int, compile_timeout_s: float, revision: str | None = None,
                 clock: Callable[[], float] = time.monotonic, max_drafts: int = 0,
                 trust_remote_code: bool = False, any_whitespace: bool = True, tokenizer_mode: str = "auto") -> None:
        self._tokenizer_path, self._vocab_size, self._revision = tokenizer_path, vocab_size, revision
        self._tokenizer_mode = tokenizer_mode
        self._trust_remote_code = trust_remote_code
        self._any_whitespace = any_whitespace
        """JSON schemas let the model write any JSON whitespace (not ``structured_output_disable_any_whitespace``)."""
        self.max_drafts = max_drafts
        """Speculative decoding's ``num_speculative_tokens``: how far a matcher rolls back after masking drafts."""
        self.compile_timeout_s = compile_timeout_s
        self._clock = clock
        self._compilers: GrammarCompilerPool | None = None
        self.pending: dict[str, _Pending] = {}
        """Requests waiting for their grammar, by request id."""
        self.matchers: dict[str, Any] = {}
        """xgrammar GrammarMatcher of every structured request handed to the scheduler."""
        self.waiting: dict[str, tuple[Marker, list[int]]] = {}
        """Requests whose constraint starts later: (its start_after marker, the output's last tokens)."""
        self.narrowed: dict[str, tuple[str, ...]] = {}
        """The fields of a structured request that forbid tokens whatever its grammar allows (`narrowing`), named
        when together they leave the grammar no token (asyncllm/structured/narrowing.py)."""
        self._bitmask: Any = None

    @property
    def active(self) -> bool:
        return bool(self.pending or self.matchers)

    # ------------------------------------------------------------ compile
    def add(self, request: Request) -> None:
        """Park `request` until its grammar compiles; `InvalidRequestError` when xgrammar is missing."""
        check_xgrammar_installed()
        if request.request_id in self.pending:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already used by an unfinished request")
        if self._compilers is None:
            self._compilers = GrammarCompilerPool(self._tokenizer_path, self._vocab_size, self._revision,
                                                  self._trust_remote_code, any_whitespace=self._any_whitespace,
                                                  tokenizer_mode=self._tokenizer_mode)
        future = self._compilers.submit(request.params.structured, request.client_id)  # type: ignore[arg-type]
        self.pending[request.request_id] = _Pending(request, future, self._clock())  # its client's turn: fair_queue.py
        request.record_event(protocol.EngineCoreEventType.QUEUED)  # waiting from now, as in vLLM (queue time)

    def abort(self, req_ids: list[str], client_id: bytes) -> None:
        """`client_id`'s parked requests among these stop waiting (their job is cancelled if nobody else waits).

        Scheduled requests' matchers go by `drop` (the core calls it with the scheduler's aborts).
        """
        for req_id in req_ids:
            entry = self.pending.get(req_id)
            if entry is not None and entry.request.client_id == client_id:
                del self.pending[req_id]
                self._release(entry)

    def abort_client(self, client_id: bytes) -> None:
        self.abort(list(self.pending), client_id)

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget the matchers (and start_after waits) of these scheduled requests, ended by an abort, a timeout or
        the workers: a new request of the same id must not inherit them."""
        for req_id in req_ids:
            self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        """Drop a scheduled request's matcher, its start_after wait and its `narrowed` fields."""
        self.matchers.pop(req_id, None)
        self.waiting.pop(req_id, None)
        self.narrowed.pop(req_id, None)

    def poll(self) -> tuple[list[Request], list[tuple[bytes, protocol.RequestOutputDelta]]]:
        """(requests whose grammar is ready, with their matchers made; deltas of failed or timed-out ones).

        A request's own `timeout` counts while it is parked (finish_reason
        "timeout"); the scheduler gets what is left of it.
        """
        ready: list[Request] = []
        failed: list[tuple[bytes, protocol.RequestOutputDelta]] = []
        if not self.pending:
            return ready, failed
        now = self._clock()
        for req_id, entry in list(self.pending.items()):
            request = entry.request
            if request.timeout is not None and now - entry.submitted_at >= request.timeout:
                del self.pending[req_id]  # the request's own timeout runs while it is parked too
                self._release(entry)
                failed.append((request.client_id, protocol.RequestOutputDelta(req_id, [], "timeout")))
                continue
            error = self._check(entry, now)
            if error is None and not entry.future.done():
                continue
            del self.pending[req_id]
            if error is None:
                error = self._make_matcher(entry)
            if error is None:
                if request.timeout is not None:  # what is left of it once the scheduler holds the request
                    request.timeout -= now - entry.submitted_at
                ready.append(request)
                continue
            self._release(entry)
            delta = protocol.RequestOutputDelta(req_id, [], "abort", error=str(error), error_type=type(error).__name__)
            failed.append((entry.request.client_id, delta))
        return ready, failed

    def _check(self, entry: _Pending, now: float) -> InvalidRequestError | None:
        """The timeout error once `compile_timeout_s` passed since a compile thread took the grammar (or since the
        vocabulary was ready): a grammar queued behind others' is not timed by their compile time."""
        if entry.future.done():
            return None
        ready_since = self._compilers.ready_since if self._compilers is not None else None
        if ready_since is None:
            return None  # the first job is still loading the tokenizer: that does not count against the grammar
        if entry.compiling_since is None:
            if not entry.future.running():
                return None  # queued: every compile thread busy with other grammars (the request's timeout runs)
            entry.compiling_since = now
        if now - max(entry.compiling_since, ready_since) < self.compile_timeout_s:
            return None
        return InvalidRequestError("structured", f"grammar compilation timed out after {self.compile_timeout_s} s "
                                                 "(structured_output_compile_timeout_s)")

    def _make_matcher(self, entry: _Pending) -> BaseException | None:
        exc = entry.future.exception()
        if exc is not None:
            if not isinstance(exc, InvalidRequestError):
                logger.error("grammar compilation failed for %s", entry.request.request_id, exc_info=exc)
                exc = InvalidRequestError("structured", f"grammar compilation failed: {type(exc).__name__}: {exc}")
            return exc
        import xgrammar as xgr

        request = entry.request
        rollback = {"max_rollback_tokens": self.max_drafts} if self.max_drafts and _bounded_rollback() else {}
        self.matchers[request.request_id] = xgr.GrammarMatcher(
            entry.future.result(), override_stop_tokens=list(request.eos_token_ids) or None, **rollback
        )
        narrowed = narrowing(request)
        if narrowed:
            self.narrowed[request.request_id] = narrowed
        else:
            self.narrowed.pop(request.request_id, None)
        start_after = Marker.of_structured(request.params.structured)  # type: ignore[arg-type]
        if start_after.ids:
            self.waiting[request.request_id] = (start_after, [])
        else:
            self.waiting.pop(request.request_id, None)
        return None

    def _release(self, entry: _Pending) -> None:
        assert self._compilers is not None
        wanted = any(e.future is entry.future for e in self.pending.values())
        self._compilers.release(entry.request.params.structured, entry.future, still_wanted=wanted)  # type: ignore[arg-type]

    # ------------------------------------------------------------ steps
    def grammar_bitmask(self, sched_out: protocol.SchedulerOutput,
                        requests: dict[str, Request]) -> protocol.GrammarBitmask | None:
        """The bitmask rows of the structured requests that sample in this step (None if none does); a drafted
        request has a row at each position the grammar constrains (`_draft_rows`).

        Also drops the matchers of requests the scheduler no longer holds
        (finished, aborted, timed out), whatever ended them.
        """
        num_scheduled, drafts = sched_out.num_scheduled_tokens, sched_out.spec_token_ids
        req_ids: list[str] = []
        for req_id in list(self.matchers):
            request = requests.get(req_id)
            if request is None:
                self._forget(req_id)
            elif req_id in self.waiting and not drafts.get(req_id) and not self._undecided(req_id):
                continue  # free text until its start_after tokens
            elif req_id in num_scheduled and request.num_computed_tokens + num_scheduled[req_id] >= request.num_tokens:
                req_ids.append(req_id)
        if not req_ids:
            return None
        bitmask = self._bitmask_rows(len(req_ids) * (1 + self.max_drafts))
        rows, positions = [], []
        for req_id in req_ids:
            for position in self._draft_rows(req_id, drafts.get(req_id, []), bitmask, len(rows)):
                rows.append(req_id)
                positions.append(position)
        if not rows:
            return None
        drafted = any(drafts.get(req_id) for req_id in req_ids)
        return protocol.GrammarBitmask(rows, bitmask[: len(rows)].numpy().tobytes(), positions if drafted else [])

    def _draft_rows(self, req_id: str, drafts: list[int], bitmask: Any, first: int) -> list[int]:
        """Fill the rows of one request from ``first``: its positions (0: before its first draft; ``len(drafts)``:
        after its last) the grammar constrains. The matcher accepts the drafts in turn for the next position's
        row, up to one it forbids (verification rejects that one, so later positions need no row), and is rolled
        back after; a request waiting for its start tokens is free text until the drafts complete them."""
        matcher, waiting = self.matchers[req_id], self.waiting.get(req_id)
        start_after, recent = (waiting[0], list(waiting[1])) if waiting else (None, [])
        undecided = self._undecided(req_id)
        positions: list[int] = []
        accepted = 0
        for position in range(len(drafts) + 1):
            if start_after is None or undecided:
                if position and matcher.is_terminated():  # a draft ended the grammar: no later row
                    break
                matcher.fill_next_token_bitmask(bitmask, first + len(positions))
                if undecided:
                    self._allow_opening(bitmask, first + len(positions), start_after)  # type: ignore[arg-type]
                positions.append(position)
            if position == len(drafts):
                break
            token = drafts[position]
            if undecided and self._leading_spaces(start_after, [token]):  # type: ignore[arg-type]
                continue  # whitespace before the first other token: still undecided
            if undecided:  # the first token: the opener waits, any other is the grammar's
                undecided = False
                start_after = start_after if token == start_after.opener[0] else None  # type: ignore[union-attr]
            if start_after is None:
                if not matcher.accept_token(token):
                    break
                accepted += 1
            else:
                recent = (recent + [token])[-start_after.span:]
                start_after = None if start_after.ends(recent) else start_after
        if accepted:
            matcher.rollback(accepted)
        return positions

    def _allow_opening(self, bitmask: Any, row: int, start_after: Marker) -> None:
        """An undecided row also allows the opener, and the whitespace tokens with `Marker.after_space`."""
        _allow(bitmask, row, start_after.opener[0])
        if start_after.after_space:
            assert self._compilers is not None
            bitmask[row] |= self._compilers.space_row

    def _leading_spaces(self, start_after: Marker, tokens: list[int]) -> int:
        """How many of `tokens` are whitespace before the first other one, with `Marker.after_space` (else 0)."""
        if not start_after.after_space:
            return 0
        assert self._compilers is not None
        spaces = self._compilers.space_tokens
        return next((k for k, token in enumerate(tokens) if token not in spaces), len(tokens))

    def _undecided(self, req_id: str) -> bool:
        """Whether a waiting request's first token (with `Marker.after_space`: other than whitespace) is still to come
        and decides whether it waits (its opener)."""
        waiting = self.waiting.get(req_id)
        return waiting is not None and bool(waiting[0].opener) and not waiting[1]

    def _bitmask_rows(self, num_rows: int) -> Any:
        """A reused int32 [rows, ceil(vocab / 32)] tensor with at least `num_rows` rows."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            assert self._compilers is not None
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self._compilers.bitmask_vocab_size)
        return self._bitmask

    def accept(self, outputs: list[tuple[bytes, protocol.RequestOutputDelta]],
               finish: Callable[[list[str]], None]) -> None:
        """Advance the matchers with this step's tokens; `finish` the requests whose grammar ended ("stop"). A token
        the grammar refuses ends its request before it ("stop") where the grammar may end and the request's
        `narrowed` fields forbade its end, else fails it (asyncllm/structured/narrowing.py); tokens accepted past the
        grammar's end (drafts after its EOS, with ignore_eos) are dropped, and it ends "stop" on that EOS."""
        ended: list[str] = []
        endings: list[tuple[bytes, protocol.RequestOutputDelta]] = []
        for client_id, delta in outputs:
            req_id = delta.request_id
            matcher = self.matchers.get(req_id)
            if matcher is None:
                continue
            tokens = self._grammar_tokens(req_id, delta.new_token_ids)
            refused = next((k for k, token in enumerate(tokens) if not matcher.accept_token(token)), None)
            if refused is not None and matcher.is_terminated():  # drafts accepted past its EOS (ignore_eos): dropped
                kept = len(delta.new_token_ids) - (len(tokens) - refused)
                delta.new_token_ids = delta.new_token_ids[:kept]
                delta.logprobs = delta.logprobs and delta.logprobs.first_rows(kept)
                if delta.finish_reason is None:
                    ended.append(req_id)
                delta.finish_reason, delta.stop_reason = "stop", None
                self._forget(req_id)
                continue
            if refused is not None and req_id in self.narrowed and may_end(matcher, self._bitmask_rows(1)):
                if delta.finish_reason is None:
                    ended.append(req_id)
                endings += stop_before(client_id, delta, len(tokens) - refused)
                self._forget(req_id)
                continue
            if refused is not None:
                delta.error = rejection(self.narrowed.get(req_id, ()), tokens[refused])
            if delta.finish_reason is not None:
                self._forget(req_id)
            elif req_id in self.waiting:
                continue
            elif matcher.is_terminated() or delta.error is not None:
                delta.finish_reason = "stop" if delta.error is None else "abort"
                self._forget(req_id)
                ended.append(req_id)
        outputs += endings
        if ended:
            finish(ended)

    def _grammar_tokens(self, req_id: str, tokens: list[int]) -> list[int]:
        """The tokens the grammar reads: all of them, or for a waiting request those after its start_after ids."""
        waiting = self.waiting.get(req_id)
        if waiting is None:
            return tokens
        start_after, recent = waiting
        if tokens and self._undecided(req_id):
            tokens = tokens[self._leading_spaces(start_after, tokens):]  # free, not the grammar's
            if tokens and tokens[0] != start_after.opener[0]:
                del self.waiting[req_id]  # the reply did not open the thinking: the rest is the grammar's
                return tokens
        for k, token in enumerate(tokens):
            recent.append(token)
            del recent[:-start_after.span]
            if start_after.ends(recent):
                del self.waiting[req_id]
                return tokens[k + 1:]
        return []

    def shutdown(self) -> None:
        if self._compilers is not None:
            self._compilers.shutdown()

    def exit_if_compiling(self) -> None:
        """End the process at once (code 0) while a compile thread is still busy, after `shutdown`.

        xgrammar's compile cannot be interrupted, and the interpreter's exit
        would wait for it, or abort in its C++ code: the engine core's `main`
        calls this last, when nothing else is left to clean up.
        """
        if self._compilers is not None and self._compilers.busy:
            logger.info("exiting without waiting for a grammar compilation still running")
            logging.shutdown()
            os._exit(0)


def _allow(bitmask: Any, row: int, token: int) -> None:
    """Set `token`'s bit in the int32 bitmask's `row` (bit 31 as the word's sign)."""
    bit = 1 << (token % 32)
    bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit


@functools.lru_cache(maxsize=1)
def _bounded_rollback() -> bool:
    """Whether xgrammar's matchers roll back only as far as asked at creation (before 0.2: newer ones always can)."""
    import inspect

    import xgrammar as xgr

    parameter = inspect.signature(xgr.GrammarMatcher).parameters.get("max_rollback_tokens")
    return parameter is not None and parameter.default != -1
