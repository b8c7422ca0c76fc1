"""Structured output on a real engine: JSON schema, regex, choices, grammars, compile timeout, abort while compiling."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams, StructuredOutputs

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.asyncio(loop_scope="module")

COMPILE_TIMEOUT_S = 1.5
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    # compact JSON: under vLLM's default any-whitespace grammar the random model writes whitespace without end
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=1024, structured_output_disable_any_whitespace=True,
                         structured_output_compile_timeout_s=COMPILE_TIMEOUT_S)
    async with engine:
        yield engine


def _slow_schema(seed: int) -> dict:
    """An enum of 25,000 random words: seconds for xgrammar on the 2-core CI machine (a few times the timeout; a regex
    or grammar that slow is refused up front: `structured.spec.MAX_GRAMMAR_CHARS`)."""
    rnd = random.Random(seed)
    return {"enum": ["".join(rnd.choice("abcdefghij") for _ in range(12)) for _ in range(25000)]}


async def _wait_stats(engine: AsyncEngine, running: int, waiting: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if (s.num_requests_running, s.num_requests_waiting) == (running, waiting) and (running or not s.num_used_blocks):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"expected running={running} waiting={waiting}: {engine.stats()}")


def _check_against_schema(value: object) -> None:
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == {"a", "b"}
        assert type(value["a"]) is int and -1000 <= value["a"] <= 1000
        assert isinstance(value["b"], str) and len(value["b"]) <= 5
    else:
        jsonschema.validate(value, SCHEMA)


async def test_fifty_seeded_json_samples_all_validate(engine: AsyncEngine) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=25, seed=seed, temperature=1.0, max_tokens=100, structured=StructuredOutputs(json=SCHEMA))

    outs = await asyncio.gather(engine.generate("Answer in JSON:", params(1)), engine.generate("JSON:", params(2)))
    samples = [o for out in outs for o in out.outputs]
    assert len(samples) == 50
    for sample in samples:
        assert sample.finish_reason == "stop", sample
        # strict=False: xgrammar's maxLength string rule admits U+0000-U+001F, which strict JSON refuses
        _check_against_schema(json.loads(sample.text, strict=False))
    assert len({s.text for s in samples}) > 10  # temperature 1.0 really sampled
    await _wait_stats(engine, 0, 0)


async def test_regex_and_choice_are_obeyed(engine: AsyncEngine) -> None:
    regex = SamplingParams(n=10, seed=3, max_tokens=30, structured=StructuredOutputs(regex=r"[a-z]{3}-\d{2}"))
    choice = SamplingParams(n=10, seed=4, max_tokens=30, structured=StructuredOutputs(choice=["yes", "no", "maybe so"]))
    by_regex, by_choice = await asyncio.gather(engine.generate("id:", regex), engine.generate("ok?", choice))
    assert all(re.fullmatch(r"[a-z]{3}-\d{2}", o.text) and o.finish_reason == "stop" for o in by_regex.outputs)
    assert all(o.text in ("yes", "no", "maybe so") and o.finish_reason == "stop" for o in by_choice.outputs)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutputs(grammar='root ::= "x" [0-9] "y"'))
    out = await engine.generate("ebnf:", greedy)
    assert re.fullmatch(r"x[0-9]y", out.text) and out.finish_reason == "stop"
    lark = StructuredOutputs(grammar='start: "x" DIGIT DIGIT? "y"\n%import common.DIGIT  // Lark, as vLLM takes it')
    by_lark = await engine.generate("lark:", SamplingParams(n=5, seed=5, max_tokens=30, structured=lark))
    assert all(re.fullmatch(r"x[0-9]{1,2}y", o.text) and o.finish_reason == "stop" for o in by_lark.outputs)


async def test_a_constraint_starts_after_its_start_after_text(engine: AsyncEngine) -> None:
    """Free text until `start_after` ("<|user|>", one token here, forced by logit_bias), then the grammar;
    already at the prompt's end, the grammar starts at once (and then forbids that token)."""
    user = engine.tokenizer.convert_tokens_to_ids("<|user|>")
    grammar = StructuredOutputs(regex=r"x[0-9]y")
    later = StructuredOutputs(regex=r"x[0-9]y", start_after="<|user|>")
    greedy = {"temperature": 0.0, "max_tokens": 12, "logit_bias": {user: 100.0}, "skip_special_tokens": False}
    free = await engine.generate("ebnf:", SamplingParams(**greedy, structured=later))
    assert free.token_ids[0] == user and re.fullmatch(r"<\|user\|>x[0-9]y(<\|eos\|>)?", free.text), free.text
    assert free.finish_reason == "stop"
    at_once = await engine.generate("ebnf:", SamplingParams(**greedy, structured=grammar))
    already = await engine.generate("ebnf:<|user|>", SamplingParams(**greedy, structured=later))
    for out in (at_once, already):  # the grammar from the first token: <|user|>, forced by the bias, is not allowed
        assert re.fullmatch(r"x[0-9]y(<\|eos\|>)?", out.text) and user not in out.token_ids, out.text


async def test_a_reply_that_does_not_open_the_thinking_is_constrained_from_its_first_token(engine: AsyncEngine) -> None:
    """`start_after_only_if_reply_opens` (mistral's ``[THINK]``, the server's): the first token decides. The opener
    ("<|user|>" here, `start_after` without its "/", one token) is allowed beside the grammar's first tokens and then
    waits for `start_after`; any other first token is the grammar's, which applies from the start."""
    user = engine.tokenizer.convert_tokens_to_ids("<|user|>")
    mistral_like = StructuredOutputs(regex=r"x[0-9]y", start_after="<|/user|>", start_after_only_if_reply_opens=True)
    greedy = {"temperature": 0.0, "max_tokens": 12, "skip_special_tokens": False, "structured": mistral_like}
    opened = await engine.generate("ebnf:", SamplingParams(**greedy, logit_bias={user: 100.0}))
    assert opened.token_ids == [user] * 12 and opened.finish_reason == "length"  # thinking: free until start_after
    answer = await engine.generate("ebnf:", SamplingParams(**greedy, logit_bias={user: -100.0}))
    assert re.fullmatch(r"x[0-9]y(<\|eos\|>)?", answer.text) and answer.finish_reason == "stop", answer.text


async def test_a_glm_constraint_starts_at_the_first_content_token_unless_the_prompt_opened(engine) -> None:
    """glm45's constraint (`start_after_opener_after_space`: whitespace does not decide): a reply whose first token
    is content is constrained from it, and the glm45 parser reads all of it as content, the constrained text; a
    prompt whose end opened the thinking (GLM-4.7's template; "<|user|>" here) makes the reply think: free until
    start_after, whatever its first token."""
    from asyncllm.reasoning import get_reasoning_parser

    tokenizer = engine.tokenizer
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    spaces = {t: -100.0 for t in range(len(tokenizer)) if tokenizer.decode([t]).isspace()}
    glm_like = StructuredOutputs(regex=r"x[0-9]y", start_after="<|/user|>", start_after_only_if_reply_opens=True,
                                 start_after_opener_after_space=True)
    greedy = {"temperature": 0.0, "max_tokens": 12, "structured": glm_like, "logit_bias": {user: -100.0, **spaces}}
    answer = await engine.generate("ebnf:", SamplingParams(**greedy))
    assert re.fullmatch(r"x[0-9]y", answer.text) and answer.finish_reason == "stop", answer.text
    assert get_reasoning_parser("glm45").parse(answer.text) == (None, answer.text)
    thinking = await engine.generate("ebnf:<|user|>", SamplingParams(**greedy))
    assert len(thinking.token_ids) == 12 and thinking.finish_reason == "length", thinking.text


@pytest.mark.parametrize("structured, why", [
    (StructuredOutputs(regex="(a"), "invalid regex: "),
    (StructuredOutputs(grammar='start: ("x" '), "invalid grammar: Lark error at line 1, column 13: expected ')'"),
])
async def test_invalid_constraint_is_a_typed_error(engine: AsyncEngine, structured, why) -> None:
    with pytest.raises(InvalidRequestError, match=f"^structured: {re.escape(why)}") as info:
        await engine.generate("x", SamplingParams(structured=structured))
    assert info.value.field == "structured"


async def test_compile_timeout_fails_the_request_and_others_keep_running(engine: AsyncEngine) -> None:
    slow = SamplingParams(max_tokens=5, structured=StructuredOutputs(json=_slow_schema(1)))
    structured = asyncio.create_task(engine.generate("slow", slow))
    await _wait_stats(engine, 0, 1)  # parked in the core, no KV block
    plain = await engine.generate("meanwhile", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(plain.token_ids) == 8 and not structured.done()
    with pytest.raises(InvalidRequestError) as info:
        await structured
    assert str(info.value) == (f"structured: grammar compilation timed out after {COMPILE_TIMEOUT_S} s "
                               "(structured_output_compile_timeout_s)")
    await _wait_stats(engine, 0, 0)


async def test_abort_while_compiling_frees_the_request(engine: AsyncEngine) -> None:
    slow = SamplingParams(max_tokens=5, structured=StructuredOutputs(json=_slow_schema(2)))
    task = asyncio.create_task(engine.generate("slow", slow))
    await _wait_stats(engine, 0, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_stats(engine, 0, 0)  # the core forgot it at once, without waiting for the compile
    out = await engine.generate("after", SamplingParams(max_tokens=10, seed=0, structured=StructuredOutputs(choice=["ok"])))
    assert out.text == "ok"


async def test_a_complete_grammar_ends_stop_where_allowed_token_ids_forbid_eos(engine: AsyncEngine) -> None:
    """allowed_token_ids of the grammar's tokens without EOS: once the grammar is complete its row is empty (token 0
    sampled, refused), and the request ends "stop" without that token (with ignore_eos too)."""
    a, b, c = (engine.tokenizer.convert_tokens_to_ids(t) for t in "abc")
    cases = [(StructuredOutputs(choice=["a", "b"]), [a, b], {"temperature": 0.0}, r"[ab]"),
             (StructuredOutputs(choice=["a", "b"]), [a, b], {"seed": 1, "ignore_eos": True}, r"[ab]"),
             (StructuredOutputs(regex="[a-c]{1,3}"), [a, b, c], {"seed": 2}, r"[a-c]{1,3}")]
    for structured, allowed, params, pattern in cases:
        out = await engine.generate("x", SamplingParams(max_tokens=8, structured=structured, allowed_token_ids=allowed,
                                                        **params))
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text
        assert set(out.token_ids) <= set(allowed)
