"""Structured output without an engine: the bitmask, the core's manager (the constraint itself:
test_structured_constraint.py)."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from asyncllm import protocol
from asyncllm import InvalidRequestError, SamplingParams, StructuredOutputs
from asyncllm.sched.request import Request
from asyncllm.structured.bitmask import apply_grammar_bitmask, unpack_bitmask


def test_missing_xgrammar_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm.structured import compiler
    from asyncllm.structured.manager import StructuredOutputManager

    monkeypatch.setattr(compiler, "_xgrammar_installed", False)
    manager = StructuredOutputManager("unused", 512, compile_timeout_s=1.0)
    with pytest.raises(InvalidRequestError) as info:
        manager.add(_request("r", StructuredOutputs(regex="a")))
    assert str(info.value) == ("structured: structured output needs the xgrammar package: "
                               "pip install 'asyncllm[structured]'")
    assert not manager.active


# ------------------------------------------------------------ the worker's mask
def test_unpack_bitmask_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    vocab_size = 77  # not a multiple of 32: the last word is partly padding
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab_size, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, words)
    allowed = unpack_bitmask(words, vocab_size)
    assert torch.equal(logits.masked_fill(~allowed, float("-inf")), expected)
    assert allowed[0, 5].item() == bool((words[0, 0].item() >> 5) & 1)


def test_apply_grammar_bitmask_maps_rows_by_request() -> None:
    logits = torch.zeros(3, 40)
    row_b = torch.zeros(2, dtype=torch.int32)
    row_b[0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (bit 31 is the int32 sign bit)
    row_b[1] = 1 << 7  # token 39
    row_a = torch.tensor([1, 0], dtype=torch.int32)  # token 0
    grammar = protocol.GrammarBitmask(["b", "a"], torch.stack([row_b, row_a]).numpy().tobytes())
    apply_grammar_bitmask(logits, grammar, ["a", "free", "b"])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [3, 31, 39]


# ------------------------------------------------------------ the core's manager
@pytest.fixture(scope="module")
def manager_args(tiny_llama: str) -> tuple[str, int]:
    pytest.importorskip("xgrammar")
    return tiny_llama, 512


def _request(req_id: str, structured: StructuredOutputs, client: bytes = b"c") -> Request:
    params = SamplingParams(max_tokens=20, structured=structured)
    message = protocol.AddRequest(req_id, [5, 6, 7], params, [1], time.time())
    return Request.from_add_request(message, client)


def _wait_polled(manager, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, failed = manager.poll()
        if ready or failed:
            return ready, failed
        time.sleep(0.01)
    raise AssertionError("nothing compiled")


def test_manager_compiles_masks_and_finishes_on_the_grammar_end(manager_args, tiny_llama: str) -> None:
    from transformers import AutoTokenizer

    from asyncllm.structured.manager import StructuredOutputManager

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0)
    request = _request("r", StructuredOutputs(choice=["yes", "no"]))
    manager.add(request)
    assert manager.pending and not manager.matchers
    ready, failed = _wait_polled(manager)
    assert ready == [request] and failed == [] and not manager.pending
    sched_out = protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {"r": 3}, 3)
    grammar = manager.grammar_bitmask(sched_out, {"r": request})
    assert grammar is not None and grammar.req_ids == ["r"]
    allowed = unpack_bitmask(torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32).view(1, -1), 512)
    allowed_text = {tokenizer.decode([t]) for t in allowed[0].nonzero().flatten().tolist()}
    assert allowed_text and all("yes".startswith(t) or "no".startswith(t) for t in allowed_text)
    finished: list[list[str]] = []
    tokens = tokenizer.encode("yes", add_special_tokens=False)
    delta = protocol.RequestOutputDelta("r", tokens)
    manager.accept([(b"c", delta)], finished.append)
    assert manager.matchers["r"].is_terminated() is False  # 'yes' is complete; EOS (1) ends it
    manager.accept([(b"c", protocol.RequestOutputDelta("r", [1]))], finished.append)
    assert finished == [["r"]] and "r" not in manager.matchers
    manager.shutdown()


def test_drafts_get_a_row_at_each_position_the_grammar_constrains(manager_args, tiny_llama: str) -> None:
    """Speculative decoding: a row before each draft and after the last, each in the state after the drafts before
    it, up to a draft the grammar forbids (verification rejects it there); the matcher is as before after."""
    from transformers import AutoTokenizer

    from asyncllm.structured.manager import StructuredOutputManager

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0, max_drafts=4)
    request = _request("r", StructuredOutputs(regex="(yes|no)+"))
    manager.add(request)
    _wait_polled(manager)
    yes, no = (tokenizer.encode(word, add_special_tokens=False) for word in ("yes", "no"))

    def rows(drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        sched_out = protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {"r": 3 + len(drafts)},
                                             3 + len(drafts), spec_token_ids={"r": drafts} if drafts else {})
        grammar = manager.grammar_bitmask(sched_out, {"r": request})
        assert grammar is not None and set(grammar.req_ids) == {"r"}
        words = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32).view(len(grammar.req_ids), -1)
        return grammar.positions or [0], unpack_bitmask(words, 512)

    _, plain = rows([])
    positions, masks = rows(yes + no + [2])  # "yes", "no", then a token the grammar forbids
    assert positions == list(range(len(yes + no) + 1))  # none after the forbidden draft
    assert torch.equal(masks[0], plain[0]) and not masks[0, 2] and masks[0, yes[0]]
    assert all(masks[j, t] for j, t in enumerate(yes + no))  # each draft allowed where it stands
    assert torch.equal(rows([])[1], plain)  # rolled back: the matcher is as before
    waiting = _request("w", StructuredOutputs(regex="(yes|no)+", start_after_token_ids=[40, 41]))
    manager.add(waiting)
    _wait_polled(manager)
    sched_out = protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {"w": 7}, 7,
                                         spec_token_ids={"w": [9, 40, 41] + yes})
    grammar = manager.grammar_bitmask(sched_out, {"w": waiting})  # free text until its drafts write 40, 41
    assert grammar is not None and grammar.positions == list(range(3, 4 + len(yes)))  # from the one after 41
    words = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32).view(len(grammar.req_ids), -1)
    assert unpack_bitmask(words, 512)[0, yes[0]] and not unpack_bitmask(words, 512)[0, 9]  # the grammar's start
    assert "w" in manager.waiting and manager.matchers["w"].is_terminated() is False
    logits = torch.zeros(6, 512)
    grammar = protocol.GrammarBitmask(["r", "r"], torch.zeros(2, 16, dtype=torch.int32).numpy().tobytes(), [0, 3])
    apply_grammar_bitmask(logits, grammar, ["r", "x"], {"r": (2, 3)})  # its draft rows from 2; its last row 0
    assert [bool(torch.isinf(row).all()) for row in logits] == [True, False, True, False, False, False]
    manager.shutdown()


def test_the_first_token_decides_a_wait_with_an_opener(manager_args, tiny_llama: str) -> None:
    """`start_after_opener_token_ids` (mistral's ``[THINK]``): the first row is the grammar's with the opener allowed
    too; an opener first waits for start_after (drafts: no rows until it), any other first token is the grammar's."""
    from transformers import AutoTokenizer

    from asyncllm.structured.manager import StructuredOutputManager

    yes = AutoTokenizer.from_pretrained(tiny_llama).encode("yes", add_special_tokens=False)
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0, max_drafts=8)
    opens = StructuredOutputs(regex="(yes|no)+", start_after="</t>", start_after_token_ids=[40, 41],
                              start_after_only_if_reply_opens=True, start_after_opener_token_ids=[3])
    opens.validate()  # the core reads the ids (its start_after text is the host's)
    requests = {r: _request(r, opens) for r in ("u", "o")}
    for request in requests.values():
        manager.add(request)
    while manager.pending:
        _wait_polled(manager)

    def rows(req_id: str, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        return _rows(manager, requests, req_id, drafts)

    positions, masks = rows("u", [])
    assert positions == [0] and masks[0, 3] and masks[0, yes[0]] and not masks[0, 9]
    assert rows("o", [3, 9, 40, 41] + yes)[0] == [0, *range(4, 5 + len(yes))]
    assert rows("o", yes)[0] == list(range(len(yes) + 1))
    manager.accept([(b"c", protocol.RequestOutputDelta("u", yes)), (b"c", protocol.RequestOutputDelta("o", [3, 9]))],
                   lambda ids: None)
    assert "u" not in manager.waiting and "o" in manager.waiting and not manager.matchers["u"].is_terminated()
    assert manager.grammar_bitmask(protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {"o": 3}, 3),
                                   requests) is None  # decided: it waits, no row
    manager.shutdown()


def _rows(manager, requests: dict[str, Request], req_id: str, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
    """The positions and allowed tokens of `req_id`'s bitmask rows in a step that drafts `drafts` for it."""
    sched_out = protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {req_id: 3 + len(drafts)},
                                         3 + len(drafts), spec_token_ids={req_id: drafts} if drafts else {})
    grammar = manager.grammar_bitmask(sched_out, requests)
    assert grammar is not None
    words = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32).view(len(grammar.req_ids), -1)
    return grammar.positions or [0], unpack_bitmask(words, 512)


def test_whitespace_before_the_first_other_token_keeps_the_wait_undecided(manager_args) -> None:
    """`start_after_opener_after_space` (glm45's: GLM-4.5 writes ``\\n<think>``): the first rows also allow the
    whitespace tokens, which keep the wait undecided, free and not the grammar's; then the opener waits for
    start_after, any other token is the grammar's first. Without it (mistral's) the first token decides."""
    from asyncllm.structured.manager import StructuredOutputManager

    newline, blank, x1y = 204, 325, [93, 22, 94]  # "\n", "\n\n", "x1y" in the tiny tokenizer
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0, max_drafts=8)
    glm = StructuredOutputs(regex="x[0-9]y", start_after="</t>", start_after_token_ids=[40, 41],
                            start_after_only_if_reply_opens=True, start_after_opener_after_space=True,
                            start_after_opener_token_ids=[3])
    glm.validate()
    mistral = msgspec.structs.replace(glm, start_after_opener_after_space=False)
    requests = {"c": _request("c", glm), "o": _request("o", glm), "m": _request("m", mistral)}
    for request in requests.values():
        manager.add(request)
    while manager.pending:
        _wait_polled(manager)
    masks = _rows(manager, requests, "c", [])[1]
    assert masks[0, x1y[0]] and masks[0, 3] and masks[0, newline] and masks[0, blank] and not masks[0, 9]
    assert not _rows(manager, requests, "m", [])[1][0, newline]
    assert _rows(manager, requests, "o", [newline, 3, 9, 40, 41] + x1y)[0] == [0, 1, 5, 6, 7, 8]
    assert _rows(manager, requests, "c", [newline, blank] + x1y)[0] == [0, 1, 2, 3, 4, 5]
    deltas = [protocol.RequestOutputDelta("c", [newline, blank, x1y[0]]), protocol.RequestOutputDelta("o", [newline])]
    manager.accept([(b"c", delta) for delta in deltas], lambda ids: None)
    assert [delta.error for delta in deltas] == [None, None] and "c" not in manager.waiting
    assert _rows(manager, requests, "o", [])[1][0, 3]  # "\n" alone: still undecided
    finished: list[list[str]] = []
    manager.accept([(b"c", protocol.RequestOutputDelta("c", x1y[1:] + [1])),
                    (b"c", protocol.RequestOutputDelta("o", [3, 9]))], finished.append)
    assert finished == [["c"]] and "o" in manager.waiting
    assert manager.grammar_bitmask(protocol.SchedulerOutput(0, [], protocol.CachedRequestData(), {"o": 3}, 3),
                                   requests) is None  # the opener decided: it waits, no row
    manager.shutdown()


def test_the_grammar_starts_after_gptoss_final_header_with_tokens_between(manager_args, tiny_llama: str) -> None:
    """gpt-oss's constraint, as the server sets it: ``<|constrain|>json`` between still starts it, as vLLM's."""
    from transformers import AutoTokenizer

    from asyncllm.reasoning import get_reasoning_parser
    from asyncllm.structured.manager import StructuredOutputManager
    from asyncllm.structured.start_after import with_start_after_ids

    tokenizer, gptoss = AutoTokenizer.from_pretrained(tiny_llama), get_reasoning_parser("openai_gptoss")
    structured = StructuredOutputs(regex="[0-9]+", start_after=gptoss.end_tag, start_after_suffix=gptoss.end_suffix,
                                   start_after_max_between=gptoss.end_max_between)
    params = with_start_after_ids(SamplingParams(max_tokens=20, structured=structured), [5, 6, 7], tokenizer, 512)
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0)
    request = Request.from_add_request(protocol.AddRequest("g", [5, 6, 7], params, [1], time.time()), b"c")
    manager.add(request)
    _wait_polled(manager)
    head = tokenizer.encode("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final <|constrain|>"
                            "json<|message|>", add_special_tokens=False)
    manager.accept([(b"c", protocol.RequestOutputDelta("g", head[:-1]))], lambda ids: None)
    assert "g" in manager.waiting  # the analysis channel, the final header without its message: free text
    manager.accept([(b"c", protocol.RequestOutputDelta("g", head[-1:] + tokenizer.encode("7", add_special_tokens=False)))],
                   lambda ids: None)
    assert "g" not in manager.waiting and not manager.matchers["g"].is_terminated()
    assert not manager.matchers["g"].accept_token(tokenizer.encode("a", add_special_tokens=False)[-1])  # the grammar's
    manager.shutdown()


def test_manager_timeout_and_abort_while_compiling(manager_args) -> None:
    from asyncllm.structured.manager import StructuredOutputManager

    now = [0.0]
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=5.0, clock=lambda: now[0])
    slow = StructuredOutputs(regex="(" + "|".join(f"{i:06d}x{i * 7919 % 999983:06d}" for i in range(10000)) + ")")
    manager.add(_request("slow", slow))
    future = manager.pending["slow"].future
    manager.add(_request("slow-2", slow))  # the same constraint: one shared job
    assert manager.pending["slow"].future is manager.pending["slow-2"].future
    manager.abort(["slow-2"], b"someone-else")  # a host aborts only its own requests
    assert "slow-2" in manager.pending
    manager.abort(["slow-2"], b"c")
    assert "slow-2" not in manager.pending and not manager.pending["slow"].future.cancelled()
    while manager._compilers.ready_since is None:  # the tokenizer loading does not count
        time.sleep(0.01)
    now[0] = time.monotonic()
    assert manager.poll() == ([], [])  # a compile thread has it from now (`compiling_since`)
    now[0] += 5.0  # past the deadline whatever ready_since is
    ready, failed = manager.poll()
    assert ready == [] and not manager.pending
    [(client, delta)] = failed
    assert client == b"c" and delta.finish_reason == "abort" and delta.error_type == "InvalidRequestError"
    assert delta.error == "structured: grammar compilation timed out after 5.0 s (structured_output_compile_timeout_s)"
    pool = manager._compilers
    assert pool.busy and pool._num_threads == 3  # the abandoned compile's thread has a replacement
    future.result(timeout=300)  # it still finishes (a C++ compile cannot be interrupted) ...
    deadline = time.monotonic() + 10
    while pool._num_threads != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._num_threads == 2 and not pool.busy  # ... and then its thread goes
    manager.shutdown()


def test_invalid_grammar_is_a_typed_error(manager_args) -> None:
    from asyncllm.structured.manager import StructuredOutputManager

    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0)
    manager.add(_request("bad", StructuredOutputs(grammar="root ::= ( 'a'")))
    ready, [(_, delta)] = _wait_polled(manager)
    assert ready == [] and delta.error is not None and delta.error.startswith("structured: invalid grammar: ")
    manager.shutdown()


def test_compiled_json_writes_the_properties_in_the_schemas_order(manager_args) -> None:
    xgr = pytest.importorskip("xgrammar")
    from asyncllm.structured.compiler import GrammarCompilerPool

    pool, compact = GrammarCompilerPool(*manager_args), GrammarCompilerPool(*manager_args, any_whitespace=False)
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    compiled, compiled_compact = (p.submit(StructuredOutputs(json=schema).for_core()).result(timeout=60)
                                  for p in (pool, compact))
    for each in (pool, compact):
        each.shutdown()
    assert xgr.GrammarMatcher(compiled).accept_string('{"reasoning": "x", "answer": 1}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"answer": 1')
    spaced = '{\n  "reasoning" : "x",\n  "answer": 1 }'  # vLLM's default: any JSON whitespace
    assert xgr.GrammarMatcher(compiled).accept_string(spaced)
    assert not xgr.GrammarMatcher(compiled_compact).accept_string(spaced)  # disable_any_whitespace: compact
    assert xgr.GrammarMatcher(compiled_compact).accept_string('{"reasoning": "x", "answer": 1}')


LARK = 'start: "SELECT " column\ncolumn: "a" | NAME\nNAME: /[x-z]+/'


def test_lark_grammar_compiles_through_xgrammars_lark_path(manager_args) -> None:
    xgr = pytest.importorskip("xgrammar")
    from asyncllm.structured.compiler import GrammarCompilerPool

    pool = GrammarCompilerPool(*manager_args)
    compiled = pool.submit(StructuredOutputs(grammar=LARK)).result(timeout=60)
    pool.shutdown()
    assert xgr.GrammarMatcher(compiled).accept_string("SELECT a") and xgr.GrammarMatcher(compiled).accept_string(
        "SELECT xyz")
    assert not xgr.GrammarMatcher(compiled).accept_string("SELECT b")


def test_lark_without_xgrammars_lark_support_names_it() -> None:
    """pyproject allows an xgrammar from before its Lark support: the request's error says what is missing."""
    import importlib.metadata
    import types

    from asyncllm.structured.compiler import GrammarCompilerPool

    pytest.importorskip("xgrammar")  # the message names its version
    pool = GrammarCompilerPool("unused", 512)
    pool._compiler = types.SimpleNamespace(compile_grammar=lambda text: "an EBNF grammar")  # no compile_lark
    lark, ebnf = pool.submit(StructuredOutputs(grammar=LARK)), pool.submit(StructuredOutputs(grammar='root ::= "a"'))
    assert ebnf.result(timeout=10) == "an EBNF grammar"
    error = lark.exception(timeout=10)
    pool.shutdown()
    assert isinstance(error, InvalidRequestError) and str(error) == (
        "structured: a Lark grammar needs an xgrammar with Lark support (GrammarCompiler.compile_lark); this server "
        f"has xgrammar {importlib.metadata.version('xgrammar')}: upgrade it, or write the grammar in GBNF/EBNF "
        "(root ::= ...)")


class _ManualPool:
    """A compile pool whose jobs the test finishes by hand."""

    ready_since = None

    def __init__(self) -> None:
        self.futures: list = []
        self.released: list = []

    def submit(self, structured: StructuredOutputs, client_id: bytes = b""):
        from concurrent.futures import Future

        self.futures.append(Future())
        return self.futures[-1]

    def release(self, structured, future, still_wanted: bool) -> None:
        self.released.append((future, still_wanted))


def test_request_timeout_counts_while_parked(manager_args) -> None:
    from asyncllm.structured.manager import StructuredOutputManager

    now = [100.0]
    manager = StructuredOutputManager(*manager_args, compile_timeout_s=60.0, clock=lambda: now[0])
    pool = manager._compilers = _ManualPool()  # type: ignore[assignment]
    for req_id in ("late", "parked-too-long"):
        request = _request(req_id, StructuredOutputs(choice=["x"]))
        request.timeout = 2.0
        manager.add(request)
    now[0] = 101.5
    assert manager.poll() == ([], [])  # vocabulary not ready: no compile timeout, request timeouts not due
    pool.futures[0].set_result(None)  # "late" compiled (a None grammar: no matcher is needed to test this)
    manager._make_matcher = lambda entry: None  # type: ignore[method-assign]
    ready, failed = manager.poll()
    assert [r.request_id for r in ready] == ["late"] and ready[0].timeout == 0.5 and failed == []
    now[0] = 102.0
    ready, [(client, delta)] = manager.poll()
    assert ready == [] and (client, delta.request_id, delta.finish_reason, delta.error) == (b"c", "parked-too-long", "timeout", None)
    assert pool.released == [(pool.futures[1], False)] and not manager.active

