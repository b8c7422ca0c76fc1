"""Property: /score, /rerank and /classify answer the engine's answer for each pair or prompt alone, in vLLM's shape.

Hypothesis draws requests over a tiny one-label cross-encoder (``Qwen3ForSequenceClassification`` with a seeded
random head, so every route serves on one engine, started once for the module):

* ``/score`` (``/v1/score``): ``text_1`` and ``text_2`` each a string or a list, 1:1, 1:N or N:N, with or without
  ``use_activation``; a text_1 list of N > 1 against a text_2 of another count is a 400 naming ``text_2`` (vLLM's
  ``_validate_score_input_lens``: N:1 included).
* ``/rerank`` (``/v1/rerank``, ``/v2/rerank``): ``query``, ``documents`` (strings or Jina's ``{"text": ...}``, repeats
  drawn so that ties happen), ``top_n`` left out, -1, 0, within or past the count, ``return_documents`` left out, true
  or false.
* ``/classify``: ``input`` in the four prompt shapes of /v1/completions (a text, texts, token ids, lists of them).

The reference is an independent model of the documented behaviour (docs/integrations/openai-server.md, vLLM's
serving_score.py) over the engine's raw logit for ONE pair or prompt (`AsyncEngine.score` with
``use_activation=False`` on a single pair, `AsyncEngine.classify` on a single prompt), memoized across examples;
the activated score is its sigmoid (one label, as the docs say), and token counts are the tokenizer's:

1. /score's ``data`` has one item per pair, in pair order (``index`` i, ``object`` "score"), each the pair's score;
   1:N pairs the one text_1 with every text_2.
2. /rerank's ``results`` are sorted by ``relevance_score``, best first, ties in input order (vLLM's stable
   ``results.sort(reverse=True)``; repeated documents give bit-equal scores most of the time, not always); each
   has its ``index`` in ``documents`` and that document's score; ``top_n`` 0 or less or past the count gives all,
   else the best ``top_n`` (no document left out scores above one kept); ``document`` is ``{"text": ...}`` (the text as
   sent) iff ``return_documents`` (default true, vLLM always sends it).
3. /classify's ``data`` is one item per input in order, ``label`` class_0, ``num_classes`` 1, ``probs`` [the
   sigmoid of the logit] (the raw logit with ``use_activation`` false, or ``softmax`` false: read first).
4. Usage: ``prompt_tokens`` == ``total_tokens`` == the sum over EVERY pair (a rerank's cut documents too) of
   ``len(tokenizer(text_1, text_2).input_ids)``; a classification's, each prompt's tokens.
5. Bad requests (empty or mistyped fields, N:M) are 400s of type invalid_request_error naming the field, and the
   server answers a good request right after.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from asyncllm import AsyncEngine
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client
from classifier_utils import tiny_classifier

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOLERANCE = 1e-5
"""A pair scored in a batch of others against the same pair alone (float32 logits, another batch shape)."""
EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "15"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="PROP_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TEXTS = ["how do I sort a list?", "sorted(items)", "import os", "x", "list.sort() sorts in place", "déjà vu"]
"""Few texts, so that pairs repeat across examples (the reference is memoized) and documents repeat (ties)."""
ID_PROMPTS = [[5, 9, 14], [7, 300, 12], [42], [100, 200, 17, 3]]  # the tiny vocabulary: 512


# ---------------------------------------------------------------- the engine, the app and the reference
@pytest.fixture(scope="module")
def reranker(tiny_qwen3: str, tmp_path_factory) -> str:
    return tiny_classifier(tiny_qwen3, str(tmp_path_factory.mktemp("score-prop")), num_labels=1, seed=3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(reranker: str):
    async with AsyncEngine(reranker, disable_log_stats=True, max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def app(engine: AsyncEngine):
    return create_app(engine, manage_engine=False)


@pytest.fixture(scope="module")
def tokenizer(reranker: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(reranker)


class Reference:
    """The engine's raw logit for one pair (one prompt) alone, each asked once per module; the activated score is
    its sigmoid (one label: docs/integrations/openai-server.md), token counts the tokenizer's (a pair's prompt is
    ``tokenizer(text_1, text_2)``, docs/pooling.md)."""

    def __init__(self, engine: AsyncEngine, tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.logits: dict[Any, float] = {}

    async def score(self, text_1: str, text_2: str, activated: bool = True) -> float:
        if (text_1, text_2) not in self.logits:
            (out,) = await self.engine.score(text_1, text_2, use_activation=False)
            self.logits[text_1, text_2] = out.score
        return _activate(self.logits[text_1, text_2], activated)

    def pair_tokens(self, text_1: str, text_2: str) -> int:
        return len(self.tokenizer(text_1, text_2).input_ids)

    async def classify(self, prompt: str | list[int], activated: bool = True) -> float:
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        if key not in self.logits:
            (self.logits[key],) = (await self.engine.classify(prompt)).logits
        return _activate(self.logits[key], activated)

    def prompt_tokens(self, prompt: str | list[int]) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.tokenizer(prompt).input_ids)


def _activate(logit: float, activated: bool) -> float:
    return 1.0 / (1.0 + math.exp(-logit)) if activated else logit


@pytest.fixture(scope="module")
def reference(engine: AsyncEngine, tokenizer) -> Reference:
    return Reference(engine, tokenizer)


async def _post(app, path: str, body: dict) -> tuple[int, dict]:
    async with asgi_client(app) as client:
        response = await client.post(path, json=body)
    return response.status_code, response.json()


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=0, abs_tol=TOLERANCE)


def _check_usage(usage: dict, tokens: int) -> None:
    assert usage["prompt_tokens"] == tokens and usage["total_tokens"] == tokens, (usage, tokens)
    assert usage.get("completion_tokens", 0) == 0, usage


# ---------------------------------------------------------------- drawn requests
_text = st.sampled_from(TEXTS)
_activation = st.sampled_from([{}, {"use_activation": True}, {"use_activation": False}, {"softmax": False}])


@st.composite
def score_bodies(draw) -> dict[str, Any]:
    """1:1, 1:N or N:N (each side a string or a list where its count allows)."""
    shape = draw(st.sampled_from(["1:1", "1:N", "N:N"]))
    count = 1 if shape == "1:1" else draw(st.integers(2, 4))
    text_2 = draw(st.lists(_text, min_size=count, max_size=count))
    if shape == "N:N":
        text_1: Any = draw(st.lists(_text, min_size=count, max_size=count))
    else:
        first = draw(_text)
        text_1 = first if draw(st.booleans()) else [first]
    if len(text_2) == 1 and draw(st.booleans()):
        text_2 = text_2[0]
    return {"text_1": text_1, "text_2": text_2, **draw(_activation)}


@st.composite
def rerank_bodies(draw) -> dict[str, Any]:
    documents = draw(st.lists(_text, min_size=1, max_size=5))
    body: dict[str, Any] = {"query": draw(_text),
                            "documents": [{"text": d} if draw(st.booleans()) else d for d in documents]}
    top_n = draw(st.sampled_from([None, -1, 0, 1, 2, len(documents), len(documents) + 3]))
    if top_n is not None:
        body["top_n"] = top_n
    returned = draw(st.sampled_from([None, True, False]))
    if returned is not None:
        body["return_documents"] = returned
    body.update(draw(st.sampled_from([{}, {"use_activation": False}])))
    return body


@st.composite
def classify_bodies(draw) -> dict[str, Any]:
    shape = draw(st.sampled_from(["text", "texts", "ids", "id lists"]))
    if shape == "text":
        prompt: Any = draw(_text)
    elif shape == "texts":
        prompt = draw(st.lists(_text, min_size=1, max_size=3))
    elif shape == "ids":
        prompt = draw(st.sampled_from(ID_PROMPTS))
    else:
        prompt = draw(st.lists(st.sampled_from(ID_PROMPTS), min_size=1, max_size=3))
    return {"input": prompt, **draw(_activation)}


# ---------------------------------------------------------------- the model of the documented answers
def _activated(body: dict) -> bool:
    """vLLM's order: ``softmax``, ``activation``, ``use_activation``; none set: true."""
    return next((body[k] for k in ("softmax", "activation", "use_activation") if body.get(k) is not None), True)


def _as_list(value: Any) -> list:
    return [value] if isinstance(value, str) else list(value)


def score_pairs(body: dict) -> list[tuple[str, str]]:
    firsts, seconds = _as_list(body["text_1"]), _as_list(body["text_2"])
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    assert len(firsts) == len(seconds), "drawn 1:1, 1:N or N:N"
    return list(zip(firsts, seconds))


def classify_prompts(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)


def _doc_text(document: str | dict) -> str:
    return document if isinstance(document, str) else document["text"]


def check_rerank_results(body: dict, results: list[dict], want: list[float]) -> None:
    """`want`: each document's reference score, in input order."""
    texts = [_doc_text(d) for d in body["documents"]]
    top_n = body.get("top_n") if (body.get("top_n") or 0) > 0 else len(texts)  # 0 or less: all (vLLM)
    assert len(results) == min(top_n, len(texts)), (results, body)
    indices = [r["index"] for r in results]
    assert len(set(indices)) == len(indices) and all(0 <= i < len(texts) for i in indices), indices
    for result in results:
        assert _close(result["relevance_score"], want[result["index"]]), (result, want)
        if body.get("return_documents", True):
            assert result["document"] == {"text": texts[result["index"]]}, result
        else:
            assert "document" not in result, result
    for a, b in zip(results, results[1:]):  # best first, ties in input order
        assert (a["relevance_score"], -a["index"]) > (b["relevance_score"], -b["index"]), results
    if not results:
        return
    last = results[-1]
    for j in set(range(len(texts))) - set(indices):  # top_n kept the best
        assert want[j] <= last["relevance_score"] + TOLERANCE, (j, want, results)
    # No check that a cut repeat of a kept document comes later: the same text twice in one request may score
    # differently in the last bits (another batch row), and then the higher one is kept, rightly.


# ---------------------------------------------------------------- running a case
async def run_score(app, reference: Reference, path: str, body: dict) -> None:
    status, got = await _post(app, path, body)
    assert status == 200, (got, body)
    pairs, activated = score_pairs(body), _activated(body)
    assert got["object"] == "list" and got["id"].startswith("score-"), got
    assert [item["index"] for item in got["data"]] == list(range(len(pairs))), got
    for item, (text_1, text_2) in zip(got["data"], pairs):
        want = await reference.score(text_1, text_2, activated)
        assert item["object"] == "score" and _close(item["score"], want), (item, want, text_1, text_2)
    _check_usage(got["usage"], sum(reference.pair_tokens(*pair) for pair in pairs))


async def run_rerank(app, reference: Reference, path: str, body: dict) -> None:
    status, got = await _post(app, path, body)
    assert status == 200, (got, body)
    texts, activated = [_doc_text(d) for d in body["documents"]], _activated(body)
    want = [await reference.score(body["query"], text, activated) for text in texts]
    assert got["id"].startswith("rerank-"), got
    check_rerank_results(body, got["results"], want)
    _check_usage(got["usage"], sum(reference.pair_tokens(body["query"], text) for text in texts))
    if currently_in_test_context():
        scores = [r["relevance_score"] for r in got["results"]]
        event("rerank: a tie among results" if len(set(scores)) < len(scores) else "rerank: no tie")


async def run_classify(app, reference: Reference, body: dict) -> None:
    status, got = await _post(app, "/classify", body)
    assert status == 200, (got, body)
    prompts, activated = classify_prompts(body["input"]), _activated(body)
    assert [item["index"] for item in got["data"]] == list(range(len(prompts))), got
    for item, prompt in zip(got["data"], prompts):
        want = await reference.classify(prompt, activated)
        assert (item["label"], item["num_classes"], len(item["probs"])) == ("class_0", 1, 1), item
        assert _close(item["probs"][0], want), (item, want, prompt)
    _check_usage(got["usage"], sum(reference.prompt_tokens(prompt) for prompt in prompts))


# ---------------------------------------------------------------- the properties
@SETTINGS
@given(path=st.sampled_from(["/score", "/v1/score"]), body=score_bodies())
@example(path="/score", body={"text_1": ["x"], "text_2": "import os"})  # a list of one against a string: 1:1
@example(path="/v1/score", body={"text_1": ["x", "import os", "x"], "text_2": ["x", "x", "déjà vu"],
                                 "softmax": False, "use_activation": True})  # softmax read first: raw logits
async def test_score_is_each_pairs_own_score(app, reference: Reference, path: str, body: dict) -> None:
    await run_score(app, reference, path, body)


@SETTINGS
@given(path=st.sampled_from(["/rerank", "/v1/rerank", "/v2/rerank"]), body=rerank_bodies())
# repeated documents (ties) cut by top_n
@example(path="/rerank", body={"query": "x", "documents": ["import os", "x", {"text": "import os"}, "x"],
                               "top_n": 3})
@example(path="/v2/rerank", body={"query": "sorted(items)", "documents": ["déjà vu", "déjà vu"], "top_n": 1,
                                  "return_documents": False})
@example(path="/v1/rerank", body={"query": "x", "documents": ["x"], "top_n": 5, "use_activation": False})
async def test_rerank_sorts_cuts_and_counts(app, reference: Reference, path: str, body: dict) -> None:
    await run_rerank(app, reference, path, body)


@SETTINGS
@given(body=classify_bodies())
@example(body={"input": [[42], [5, 9, 14]], "use_activation": False})
@example(body={"input": [42]})  # token ids: one prompt, not a list of prompts
async def test_classify_is_each_prompts_own_class(app, reference: Reference, body: dict) -> None:
    await run_classify(app, reference, body)


BAD = [
    ("/score", {"text_1": ["x", "import os"], "text_2": ["x", "x", "x"]}, "text_2"),  # N:M
    ("/score", {"text_1": ["x", "import os"], "text_2": "x"}, "text_2"),  # N:1 (vLLM's too)
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/score", {"text_1": "x", "text_2": []}, "text_2"),
    ("/score", {"text_1": 3, "text_2": "x"}, "text_1"),
    ("/score", {"text_1": "x", "text_2": ["x", 4]}, "text_2"),
    ("/score", {"text_1": "x", "text_2": ["x", ""]}, "text_2"),
    ("/score", {"text_2": "x"}, "text_1"),
    ("/rerank", {"query": "x", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "x", "documents": ["x", 7]}, "documents"),
    ("/v2/rerank", {"query": "x", "documents": ["x", ""]}, "documents"),
    ("/rerank", {"query": "x", "documents": [{"txt": "x"}]}, "documents"),
    ("/rerank", {"query": ["x"], "documents": ["x"]}, "query"),
    ("/rerank", {"query": "", "documents": ["x"]}, "query"),
    ("/rerank", {"query": "x", "documents": ["x"], "top_n": "two"}, "top_n"),
    ("/rerank", {"query": "x", "documents": ["x"], "return_documents": "maybe"}, "return_documents"),
    ("/rerank", {"documents": ["x"]}, "query"),
    ("/classify", {"input": ""}, "input"),
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": [1, "x"]}, "input"),
    ("/classify", {"input": None}, "input"),
]


@SETTINGS
@given(bad=st.sampled_from(BAD), good=st.one_of(score_bodies().map(lambda b: ("/score", b)),
                                                  rerank_bodies().map(lambda b: ("/rerank", b)),
                                                  classify_bodies().map(lambda b: ("/classify", b))))
async def test_bad_requests_are_400s_naming_the_field_and_the_server_goes_on(app, reference: Reference, bad: tuple,
                                                                           good: tuple) -> None:
    path, body, field = bad
    status, got = await _post(app, path, body)
    assert status == 400, (got, body)
    assert (got["error"]["type"], got["error"]["param"]) == ("invalid_request_error", field), (got, body)
    good_path, good_body = good
    if good_path == "/score":
        await run_score(app, reference, good_path, good_body)
    elif good_path == "/rerank":
        await run_rerank(app, reference, good_path, good_body)
    else:
        await run_classify(app, reference, good_body)


async def test_every_bad_request_is_named(app) -> None:
    """Each of BAD once (the property above samples them)."""
    for path, body, field in BAD:
        status, got = await _post(app, path, body)
        assert (status, got["error"]["param"]) == (400, field), (path, body, got)
