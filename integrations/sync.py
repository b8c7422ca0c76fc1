"""`SyncEngine`: a thread-safe blocking facade for code without an event loop.

Celery tasks, scripts, notebooks and thread pools call ``generate`` /
``stream`` / ``chat`` like ordinary functions. The facade owns a private event
loop in one background thread where its `AsyncEngine` lives; every call posts a
coroutine there with `asyncio.run_coroutine_threadsafe` and waits on the
future, so any number of threads may call it at once and their requests are
batched together by the engine. It also works from inside a running loop's
thread pool (``await loop.run_in_executor(None, engine.generate, ...)``);
calling it on its own loop's thread would deadlock and raises instead. `close`
ends every call still waiting (`EngineDeadError`), and posts nothing after.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from asyncllm.errors import EngineDeadError
from asyncllm.procutil import check_not_forked, forked

if TYPE_CHECKING:
    from asyncllm.beam_search import BeamSearchOutput, BeamSearchParams
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.lora import LoRARequest
    from asyncllm.outputs import EngineStats, RequestOutput, StreamDelta
    from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingOutput, PoolingParams, ScoringOutput
    from asyncllm.sampling import SamplingParams
    from asyncllm.speech_segments import Segment

__all__ = ["SyncEngine"]

T = TypeVar("T")

CLOSED = "this SyncEngine was closed; create a new one"
OWN_THREAD = ("SyncEngine called from its own loop thread would deadlock; "
              "in a coroutine use the AsyncEngine (`sync_engine.engine`) and await it")
CANCEL_WAIT_S = 10.0
"""How long close() lets cancelled calls clean up before it stops the loop (their callers get `EngineDeadError`)."""
FINISH_WAIT_S = 30.0
"""How long a stream left early waits for its abort to be posted (a moment on a loop that runs; then it goes on)."""


class SyncEngine:
    """Blocking calls over an `AsyncEngine` that runs on a private loop thread.

    ``SyncEngine(model, **fields)`` takes what `AsyncEngine` takes (no model:
    the bundled tiny one); `SyncEngine.connect(address)` attaches to a shared
    standalone core. Starting is lazy (the first call) unless `start` is called;
    `close` (or leaving ``with``) stops the engine and the thread.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from asyncllm.engine.async_engine import AsyncEngine

        self._setup(lambda: AsyncEngine(model, **kwargs))

    @classmethod
    def connect(cls, address: str | None = None, **kwargs: Any) -> "SyncEngine":
        """Attach to a standalone core (``asyncllm engine``), as `AsyncEngine.connect`."""
        from asyncllm.engine.async_engine import AsyncEngine

        engine = cls.__new__(cls)
        engine._setup(lambda: AsyncEngine.connect(address, **kwargs))
        return engine

    def _setup(self, make_engine: Any) -> None:
        self._engine: AsyncEngine = make_engine()  # cheap: nothing starts before the first call
        self._owner_pid = os.getpid()  # its loop thread does not cross os.fork(): a forked child cannot use it
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._stopping = False
        """close() is past the engine's aclose(): nothing more is posted to the loop (`_post`), which stops."""
        self._close_lock = threading.RLock()
        """An RLock: a stream collected (GC) by `_post`'s allocations under it re-enters `_post` (`_finish`)."""
        self._futures: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        """What `_post` handed out: close() ends those a stopped loop leaves undone (`_fail_the_rest`)."""
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name="asyncllm-sync-loop", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> AsyncEngine:
        """The `AsyncEngine` behind the facade (use it only from coroutines run with `run`)."""
        return self._engine

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "SyncEngine":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the engine now (otherwise the first request does)."""
        self.run(self._engine.start())

    def close(self) -> None:
        """Abort what is in flight, stop the engine, then the loop thread. Idempotent; any thread but its loop's."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(OWN_THREAD)  # it would wait for the loop it is blocking
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if forked(self._owner_pid):  # its parent's engine, serving on there, is only dropped (no loop thread here)
            return
        try:
            self._call(self._engine.aclose())
        finally:
            with self._close_lock:
                self._stopping = True
            self._stop_loop()

    def _stop_loop(self) -> None:
        """As `asyncio.run` ends: cancel what still runs on the loop (a call from another thread; its caller gets
        `EngineDeadError`, none waits forever), then stop and close the loop."""
        try:
            # its own wait is CANCEL_WAIT_S; the margin covers a loop busy with what it cancels
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result(timeout=CANCEL_WAIT_S + 20)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            try:
                self._loop.close()
            finally:
                self._fail_the_rest()

    def _fail_the_rest(self) -> None:
        """End the calls a stopped loop never will: their coroutine's cancellation cleanup ran past `CANCEL_WAIT_S`."""
        for future in list(self._futures):
            try:
                future.set_exception(EngineDeadError(CLOSED))
            except concurrent.futures.InvalidStateError:
                pass  # done already

    # ------------------------------------------------------------ requests
    def generate(self, prompt: Any, params: SamplingParams | None = None, **options: Any) -> RequestOutput:
        """Run one request to the end (options as for `AsyncEngine.generate`); `EngineDeadError` when `close` cut
        it short (the engine's close aborts it: its output would look complete but for its finish reason)."""
        return self._whole([self.run(self._engine.generate(prompt, params, **options))])[0]

    def embed(self, prompt: Any, pooling_params: PoolingParams | None = None, **options: Any) -> EmbeddingOutput:
        """The embedding of a prompt (options as for `AsyncEngine.embed`)."""
        return self.run(self._engine.embed(prompt, pooling_params, **options))

    def encode(self, prompt: Any, pooling_params: PoolingParams | None = None, **options: Any) -> PoolingOutput:
        """vLLM's ``LLM.encode``: the pooler's output for ``pooling_task`` (options as for `AsyncEngine.encode`)."""
        return self.run(self._engine.encode(prompt, pooling_params, **options))

    def reward(self, prompt: Any, pooling_params: PoolingParams | None = None, **options: Any) -> PoolingOutput:
        """vLLM's ``LLM.reward``: a reward model's rows (see `AsyncEngine.reward`)."""
        return self.run(self._engine.reward(prompt, pooling_params, **options))

    def classify(self, prompt: Any, **options: Any) -> ClassificationOutput:
        """A classifier's verdict on a prompt (options as for `AsyncEngine.classify`)."""
        return self.run(self._engine.classify(prompt, **options))

    def score(self, text_1: str | list[str], text_2: str | list[str], **options: Any) -> list[ScoringOutput]:
        """vLLM's ``LLM.score``: one `ScoringOutput` per pair (see `AsyncEngine.score`)."""
        return self.run(self._engine.score(text_1, text_2, **options))

    def transcribe(self, audio: Any, **options: Any) -> Iterator[str]:
        """Iterate the text of `audio` as it comes (Whisper; options as for `AsyncEngine.transcribe`); leaving the
        loop early aborts what still runs."""
        return self._iterate(lambda: self._engine.transcribe(audio, **options))

    def transcribe_segments(self, audio: Any, **options: Any) -> list[Segment]:
        """`transcribe` with timestamps (see `AsyncEngine.transcribe_segments`)."""
        return self.run(self._engine.transcribe_segments(audio, **options))

    def generate_many(self, prompts: Any, params: Any = None, *, progress: bool = False,
                      max_concurrency: int | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """A batch job, results in input order (see `AsyncEngine.generate_many`); `EngineDeadError` when `close` cut
        it short, as `generate`."""
        return self._whole(self.run(self._engine.generate_many(prompts, params, progress=progress,
                                                               max_concurrency=max_concurrency,
                                                               lora_request=lora_request)))

    def _whole(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs`, unless `close` aborted one of them (finish_reason "abort": it would pass for a whole output,
        in a batch job above all): then `EngineDeadError`, as every other call close ends."""
        if self._closed and any(sample.finish_reason == "abort" for output in outputs for sample in output.outputs):
            raise EngineDeadError(CLOSED)
        return outputs

    def stream(self, prompt: Any, params: SamplingParams | None = None, **options: Any) -> Iterator[StreamDelta]:
        """Iterate `StreamDelta`s as they come; leaving the loop early aborts the request."""
        return self._iterate(lambda: self._engine.stream(prompt, params, **options))

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **options: Any) -> Iterator[StreamDelta]:
        """Iterate the deltas of a reply to chat `messages` (see `stream`; options as for `AsyncEngine.chat`, vLLM's
        `sampling_params` among them)."""
        return self._iterate(lambda: self._engine.chat(messages, params, **options))

    def beam_search(self, prompt: Any, params: BeamSearchParams, **options: Any) -> BeamSearchOutput:
        """Beam search (see `AsyncEngine.beam_search`)."""
        return self.run(self._engine.beam_search(prompt, params, **options))

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by id, from any thread: their streams end with finish_reason "abort" (see
        `AsyncEngine.abort`; an unknown or finished id is ignored)."""
        self.run(self._engine.abort(request_id))

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer, the engine started if needed (see `AsyncEngine.get_tokenizer`)."""
        return self.run(self._engine.get_tokenizer())

    def default_sampling_params(self) -> SamplingParams:
        """What a request without `SamplingParams` runs with, the engine started if needed (see
        `AsyncEngine.default_sampling_params`)."""
        self.start()
        return self._engine.default_sampling_params()

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check a LoRA adapter now and bind its id (see `AsyncEngine.add_lora`)."""
        self.run(self._engine.add_lora(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Forget LoRA adapter id `lora_id`; whether any replica knew it (see `AsyncEngine.remove_lora`)."""
        return self.run(self._engine.remove_lora(lora_id))

    def list_loras(self) -> set[int]:
        """The LoRA adapter ids checked and bound (see `AsyncEngine.list_loras`)."""
        return self.run(self._engine.list_loras())

    def pin_lora(self, lora_id: int) -> bool:
        """Keep LoRA adapter id `lora_id` from eviction; True (see `AsyncEngine.pin_lora`)."""
        return self.run(self._engine.pin_lora(lora_id))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (see `AsyncEngine.reset_prefix_cache`)."""
        return self.run(self._engine.reset_prefix_cache())

    def update_weights(self, model_path: str, *, revision: str | None = None) -> int:
        """Reload the weights in place from `model_path` (see `AsyncEngine.update_weights`); the new version."""
        return self.run(self._engine.update_weights(model_path, revision=revision))

    def update_weights_from_tensors(self, named_tensors: Any) -> int:
        """Write (name, tensor) pairs into the weights in place (see `AsyncEngine.update_weights_from_tensors`);
        the new version."""
        return self.run(self._engine.update_weights_from_tensors(named_tensors))

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory of the weights and the KV cache (see `AsyncEngine.sleep`)."""
        self.run(self._engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back, all of it or the parts in `tags` (see `AsyncEngine.wake_up`)."""
        self.run(self._engine.wake_up(tags))

    def is_sleeping(self) -> bool:
        """Whether any part of the engine's memory sleeps (see `AsyncEngine.is_sleeping`)."""
        return self.run(self._engine.is_sleeping())

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run any coroutine on the engine's loop and wait for its result (thread-safe)."""
        self._check_open(coro)
        return self._call(coro)

    # ------------------------------------------------------------ internals
    def _iterate(self, make_stream: Any) -> Iterator[Any]:
        """A sync iterator over an async one made on demand (a `RequestStream`, or `transcribe`'s generator)."""
        self._check_open()
        stream: AsyncIterator[Any] = make_stream()
        try:
            while True:
                try:
                    delta = self._call(stream.__anext__())
                except StopAsyncIteration:
                    return
                except EngineDeadError:
                    if self._stopping and getattr(stream, "exhausted", False):
                        return  # closed after its last delta (close() aborts it: finish_reason "abort"): it ends
                    raise
                yield delta
        finally:  # break, exception or garbage collection of the generator: abort the request
            if not self._closed:
                self._finish(stream.aclose())  # type: ignore[attr-defined] - streams and async generators have it

    def _finish(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` on the loop: waited for, unless this is the loop's own thread (a generator in a reference
        cycle collected there), which cannot wait for its own loop, or a thread holding `_close_lock` (collected in
        `_post` or close()), whose wait would stall the loop's next `_post`: there it is only scheduled. Nothing
        once close() stops the loop: its aclose() aborted every request; nor at the interpreter's exit (a stream left
        open to the end, closed as its module is torn down), when the loop's daemon thread runs no more: the core
        ends with the host. A loop that runs posts the abort in a moment: it is waited for `FINISH_WAIT_S` at most."""
        if sys.is_finalizing() or not self._thread.is_alive():
            coro.close()
            return
        future = self._post(coro)
        if future is not None and threading.current_thread() is not self._thread \
                and not self._close_lock._is_owned():
            try:
                concurrent.futures.wait([future], timeout=FINISH_WAIT_S)
            except BaseException:
                future.cancel()  # KeyboardInterrupt in the wait, as `_wait`
                raise
            try:
                if future.done():
                    self._wait(future)
            except EngineDeadError:
                if not self._stopping:
                    raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future = self._post(coro)
        if future is None:
            raise EngineDeadError(CLOSED)
        return self._wait(future)

    def _post(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T] | None:
        """`coro` scheduled on the loop; None (`coro` closed, never run) once close() stops it, which would leave
        the call waiting forever or raise "Event loop is closed"."""
        with self._close_lock:
            if not self._stopping:
                future = asyncio.run_coroutine_threadsafe(coro, self._loop)
                self._futures.add(future)
                return future
        coro.close()
        return None

    def _wait(self, future: concurrent.futures.Future[T]) -> T:
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._stopping:  # cancelled by close() (`_stop_loop`)
                raise EngineDeadError(CLOSED) from None
            raise
        except BaseException:
            future.cancel()  # KeyboardInterrupt in the caller: cancel the coroutine (its stream aborts)
            raise

    def _check_open(self, coro: Coroutine[Any, Any, Any] | None = None) -> None:
        try:
            check_not_forked(self._owner_pid, "SyncEngine")
            if self._closed:
                raise EngineDeadError(CLOSED)
            if threading.current_thread() is self._thread:
                raise RuntimeError(OWN_THREAD)
        except BaseException:
            if coro is not None:
                coro.close()  # never awaited: close it so Python does not warn
            raise

    def __del__(self) -> None:
        # A forgotten close: stop the loop thread, which then closes the loop (`_run_loop`); the dropped AsyncEngine
        # is then collected and stops its processes.
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed() and not getattr(self, "_closed", True) \
                and not forked(self._owner_pid):
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: `loop` until it is stopped, then closed (its selector and self-pipe: a SyncEngine collected
    without close() leaves no file descriptor; close() closes it after the thread ended, which does nothing more)."""
    loop.run_forever()
    loop.close()


async def _cancel_the_rest() -> None:
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
