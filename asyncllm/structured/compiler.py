"""Grammar compilation off the core's step loop: a small thread pool and a cache of compiled grammars.

xgrammar compiles a JSON schema, regex, choice list or grammar (EBNF or Lark) against the
model's vocabulary (its `TokenizerInfo`, built once, lazily, from the model
folder's tokenizer: the core holds no tokenizer otherwise). Compiling can take
from microseconds to minutes (a pathological grammar), so the core never
waits: it submits, keeps stepping the other requests, and polls.

A compile job is shared by every request with the same constraint (the
samples of an n > 1 request, repeated schemas) through the cache: one future
per (kind, text), keyed by their sha256 digest (no client-sized text is kept
once the job is done) and kept after it finishes, least recently used first:
at most `_CACHE_SIZE` entries and ASYNCLLM_XGRAMMAR_CACHE_MB MiB of compiled
grammars (xgrammar's `memory_size_bytes`, vLLM's VLLM_XGRAMMAR_CACHE_MB); a
grammar larger than that alone serves its requests without being kept. A job
nobody waits for any more is cancelled if it has not started; one already
running in xgrammar's C++ cannot be interrupted, so it finishes in the
background and its result stays in the cache for the next request.

The threads take the jobs fairly between clients (asyncllm/structured/fair_queue.py):
the client that runs the fewest compiles first, in turns, and one more thread
(up to `_MAX_THREADS`) for a client whose grammar waits while another client's
slow ones hold more than their share of the threads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from asyncllm import envs
from asyncllm.errors import InvalidRequestError
from asyncllm.structured.fair_queue import CompileJob, FairJobQueue
from asyncllm.structured.spec import StructuredOutputs, looks_like_lark

__all__ = ["GrammarCompilerPool", "check_xgrammar_installed"]

_CACHE_SIZE = 256
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")
"""xgrammar's C++ errors start with its log line's time and source position (``[05:32:42] /project/cpp/x.cc:94: ``)."""
_XGRAMMAR_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")
"""... and a failed check with the C++ condition (``Check failed: (val <= MAX_INT64_AS_DOUBLE) is false: ``)."""
_NUM_THREADS = 2
"""Compile threads for queued jobs. Daemon threads (not a ThreadPoolExecutor, whose threads the
interpreter joins at exit): a runaway compile must not delay the core's shutdown."""
_MAX_THREADS = 8
"""Threads at most, counting those still busy with an abandoned (timed-out or aborted) compile and those started
for a starved client (`FairJobQueue.starved`)."""

_xgrammar_installed: bool | None = None


def check_xgrammar_installed() -> None:
    """Raise `InvalidRequestError` on 'structured' when xgrammar cannot be imported (checked once)."""
    global _xgrammar_installed
    if _xgrammar_installed is None:
        _xgrammar_installed = importlib.util.find_spec("xgrammar") is not None
    if not _xgrammar_installed:
        raise InvalidRequestError(
            "structured", "structured output needs the xgrammar package: pip install 'asyncllm[structured]'"
        )


def constraint_digest(key: tuple[str, str]) -> bytes:
    """The cache's key of a constraint's (kind, text): their sha256 digest (a kind has no NUL)."""
    kind, text = key
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).digest()


class GrammarCache:
    """Compiled grammars' futures by constraint digest, least recently used first: at most `_CACHE_SIZE` entries
    and `limit_bytes` of compiled grammars and keys. Used by the core and the compile threads (a lock)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[bytes, tuple[Future[Any], int]] = OrderedDict()
        """digest -> (future, bytes: its key's, plus its grammar's once compiled)."""
        self.num_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Future[Any] | None:
        """The future of `key` (now the most recently used), if cached."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return None if entry is None else entry[0]

    def add(self, key: bytes, future: Future[Any]) -> None:
        """Cache `future` as `key`'s (replacing a failed or cancelled one), the least recently used past `_CACHE_SIZE`
        going (a compile in flight too: its requests keep their future)."""
        with self._lock:
            self._pop(key)
            self._entries[key] = (future, sys.getsizeof(key))
            self.num_bytes += sys.getsizeof(key)
            if len(self._entries) > _CACHE_SIZE:
                self._pop(next(iter(self._entries)))

    def compiled(self, key: bytes, future: Future[Any], grammar_bytes: int) -> None:
        """`future`'s compile succeeded with a grammar of `grammar_bytes`: the least recently used compiled grammars
        go until the cache fits its limit; one over the limit alone is not kept (its requests have it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not future:  # evicted or released meanwhile
                return
            if entry[1] + grammar_bytes > self.limit_bytes:
                self._pop(key)
                return
            self._entries[key] = (future, entry[1] + grammar_bytes)  # keeps its place
            self.num_bytes += grammar_bytes
            for old in [k for k, (f, _) in self._entries.items() if k != key and f.done()]:
                if self.num_bytes <= self.limit_bytes:
                    break
                self._pop(old)

    def discard(self, key: bytes, future: Future[Any]) -> None:
        """Forget `key` if `future` is still its entry."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is future:
                self._pop(key)

    def futures(self) -> list[Future[Any]]:
        with self._lock:
            return [future for future, _ in self._entries.values()]

    def _pop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry[1]


class GrammarCompilerPool:
    """Compiles constraints in background threads; `submit` returns the shared future of a compiled grammar."""

    def __init__(self, tokenizer_path: str, vocab_size: int, revision: str | None = None,
                 trust_remote_code: bool = False, any_whitespace: bool = True, tokenizer_mode: str = "auto") -> None:
        self._tokenizer_path, self._tokenizer_mode = tokenizer_path, tokenizer_mode
        self._any_whitespace = any_whitespace
        """A JSON schema's grammar lets the model write any JSON whitespace, as vLLM's xgrammar backend by default
        (``any_whitespace=not disable_any_whitespace``); False: xgrammar's compact layout."""
        self._revision = revision
        self._trust_remote_code = trust_remote_code
        self._vocab_size = vocab_size
        self._jobs = FairJobQueue()
        """The queued jobs by client: a job's constraint text is held until it is done."""
        self._threads_lock = threading.Lock()
        self._num_threads = 0
        self._abandoned: set[Future[Any]] = set()
        """Running compiles nobody waits for whose thread has a replacement: that thread exits when it is done."""
        self._num_extra = 0
        """Threads started for a starved client (`FairJobQueue.starved`): the next ones to finish a job go."""
        self._num_busy = 0
        for _ in range(_NUM_THREADS):
            self._start_thread()
        self._cache = GrammarCache(envs.XGRAMMAR_CACHE_MB.get() * 2**20)
        self._compiler: Any = None
        self._tokenizer_info: Any = None
        self._compiler_lock = threading.Lock()
        self.ready_since: float | None = None
        """time.monotonic() when the vocabulary became ready; compile timeouts count from then at the earliest."""

    @property
    def busy(self) -> bool:
        """Whether a thread is compiling right now."""
        return self._num_busy > 0

    @property
    def bitmask_vocab_size(self) -> int:
        """Tokens a bitmask row covers: the model's vocabulary (after the first compile job loaded it)."""
        return self._tokenizer_info.vocab_size

    @functools.cached_property
    def space_tokens(self) -> frozenset[int]:
        """The tokens whose text is all whitespace (after the first compile job loaded the vocabulary): free before an
        output's first other token decides whether it thinks (`Marker.after_space`, GLM-4.5's ``\\n<think>``)."""
        return frozenset(i for i, text in enumerate(self._tokenizer_info.decoded_vocab) if text and text.isspace())

    @functools.cached_property
    def space_row(self) -> Any:
        """`space_tokens` as one bitmask row's int32 words (OR-ed into an undecided output's rows)."""
        from asyncllm.structured.bitmask import pack_tokens

        return pack_tokens(self.space_tokens, (self.bitmask_vocab_size + 31) // 32)

    def submit(self, structured: StructuredOutputs, client_id: bytes = b"") -> Future[Any]:
        """The future of `structured`'s compiled grammar: from the cache, or a new job in `client_id`'s queue (a queued
        job of another client's: in this client's queue too, it runs at the first of their turns)."""
        constraint = structured.cache_key()
        key = constraint_digest(constraint)
        future = self._cache.get(key)
        if future is None or future.cancelled() or (future.done() and future.exception() is not None):
            future = Future()
            self._cache.add(key, future)
        elif future.running() or future.done():
            return future
        self._jobs.put(CompileJob(future, key, constraint), client_id)
        with self._threads_lock:
            if self._num_threads < _MAX_THREADS and self._jobs.starved(self._num_threads - len(self._abandoned)):
                self._num_extra += 1
                self._start_thread()
        return future

    def release(self, structured: StructuredOutputs, future: Future[Any], still_wanted: bool) -> None:
        """A request stopped waiting for `future` (aborted, timed out).

        If nobody else waits: a queued job is cancelled; a running one cannot
        be, so its thread is abandoned to finish (its grammar stays cached)
        and a new thread serves the queue meanwhile (one per job), up to `_MAX_THREADS`.
        """
        if still_wanted or future.done():
            return
        if future.cancel():
            self._cache.discard(constraint_digest(structured.cache_key()), future)
            return
        with self._threads_lock:
            # done: its thread already went on serving (it checks `_abandoned` under this lock after finishing)
            if not future.done() and future not in self._abandoned and self._num_threads < _MAX_THREADS:
                self._abandoned.add(future)
                self._start_thread()

    def shutdown(self) -> None:
        """Stop the threads once they finish their current job (queued jobs are cancelled)."""
        for future in self._cache.futures():
            future.cancel()
        self._jobs.close()

    # ------------------------------------------------------------ compile threads
    def _start_thread(self) -> None:
        self._num_threads += 1
        self._jobs.add_thread()
        threading.Thread(target=self._work, name="asyncllm-grammar", daemon=True).start()

    def _work(self) -> None:
        while (taken := self._jobs.take()) is not None:
            job, client_id = taken
            leaving = self._run(job.future, job.key, job.constraint)
            self._jobs.done(client_id, leaving)
            if leaving:
                return
            del job, taken  # nothing of the job (its text, an uncached grammar) is held while waiting for the next
        with self._threads_lock:
            self._num_threads -= 1

    def _run(self, future: Future[Any], key: bytes, constraint: tuple[str, str]) -> bool:
        """Compile `constraint` into `future` (marked running by `FairJobQueue.take`); True when this thread goes:
        replaced (`_abandoned`) or one too many (`_num_extra`)."""
        with self._threads_lock:
            self._num_busy += 1
        try:
            grammar = self._compile(constraint)
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiting requests by the core's poll
            future.set_exception(exc)
            self._cache.discard(key, future)  # a later request compiles anew: nothing (its traceback's text) is kept
        else:
            future.set_result(grammar)
            self._cache.compiled(key, future, getattr(grammar, "memory_size_bytes", 0))  # a test's fake grammar: 0
        with self._threads_lock:
            self._num_busy -= 1
            if future in self._abandoned:  # this thread was replaced: it goes, its replacement stays
                self._abandoned.discard(future)
                self._num_threads -= 1
                return True
            if self._num_extra:  # the pool is back to its size once a started-for-fairness thread's worth is done
                self._num_extra -= 1
                self._num_threads -= 1
                return True
        return False

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
                _ = self.space_row  # built here, on a compile thread, not on first use in the core's step
                self.ready_since = time.monotonic()
            return self._compiler

    def _build_compiler(self) -> Any:
        import xgrammar as xgr

        from asyncllm.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self._tokenizer_path, self._revision, self._tokenizer_mode, self._trust_remote_code)
        info = self._tokenizer_info = _tokenizer_info(tokenizer, self._vocab_size or None)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, key: tuple[str, str]) -> Any:
        kind, text = key
        compiler = self._get_compiler()
        lark = kind == "grammar" and looks_like_lark(text)
        if lark:
            _check_lark_support(compiler)
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=self._any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(text)))
            return compiler.compile_lark(text) if lark else compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as exc:  # xgrammar's parse errors: the user's constraint is invalid
            message = _XGRAMMAR_LOG_PREFIX.sub("", str(exc)).strip()  # the client sees the message only
            message = _XGRAMMAR_CHECK_PREFIX.sub("", message)
            raise InvalidRequestError("structured", f"invalid {kind}: {message}") from None


def _tokenizer_info(tokenizer: Any, vocab_size: int | None) -> Any:
    """xgrammar's view of the vocabulary: read from a Hugging Face tokenizer, or mistral_common's spelled out
    (`xgrammar_vocab`; a sentencepiece model's pieces add the prefix space, as xgrammar's own reading does)."""
    import xgrammar as xgr

    from asyncllm.mistral_tokenizer import is_mistral, xgrammar_vocab

    if not is_mistral(tokenizer):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    vocab, tekken = xgrammar_vocab(tokenizer)
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW if tekken else xgr.VocabType.BYTE_FALLBACK,
                             vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id],
                             add_prefix_space=not tekken)


def _check_lark_support(compiler: Any) -> None:
    if not hasattr(compiler, "compile_lark"):  # pyproject allows xgrammar releases without Lark
        raise InvalidRequestError("structured", "a Lark grammar needs an xgrammar with Lark support "
                                  "(GrammarCompiler.compile_lark); this server has xgrammar "
                                  f"{importlib.metadata.version('xgrammar')}: upgrade it, or write the grammar in "
                                  "GBNF/EBNF (root ::= ...)")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
