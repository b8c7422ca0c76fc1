"""``POST /score`` and ``/rerank`` over a generative model: each score is the cosine similarity of the two texts'
embeddings (transformers' last hidden states), results sorted by relevance with ``top_n`` and ``return_documents``;
the refusals are 400s naming the field. (A cross-encoder's routes: tests/engine/test_classification.py.)"""

from __future__ import annotations

import math

import pytest

from asgi_helpers import asgi_client
from hf_reference import hf_last_hidden_state

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOLERANCE = 1e-5
QUERY = "def add(a, b):"
DOCS = ["    return a + b", "import os", "class Matrix:", "def sub(a, b):"]


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def want(bundled_tokenizer) -> tuple[dict[str, float], dict[str, int]]:
    """Each document's cosine similarity to the query (transformers), and every text's token count."""
    from asyncllm.bundled import bundled_model_path

    ids = {text: bundled_tokenizer(text).input_ids for text in [QUERY, *DOCS]}
    hidden = {text: hf_last_hidden_state(bundled_model_path(), token_ids) for text, token_ids in ids.items()}
    return {doc: _cosine(hidden[QUERY], hidden[doc]) for doc in DOCS}, {text: len(t) for text, t in ids.items()}


async def _post(app, path: str, body: dict, status: int = 200) -> dict:
    async with asgi_client(app) as client:
        response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


async def test_scores_are_the_cosine_of_the_embeddings(app, want) -> None:
    scores, lengths = want
    one_to_n = await _post(app, "/score", {"text_1": QUERY, "text_2": DOCS})
    n_to_n = await _post(app, "/v1/score", {"text_1": [QUERY, DOCS[1]], "text_2": [DOCS[0], QUERY]})
    assert [item["index"] for item in one_to_n["data"]] == [0, 1, 2, 3]
    for item, doc in zip(one_to_n["data"], DOCS):
        assert item["object"] == "score" and abs(item["score"] - scores[doc]) < TOLERANCE
    assert abs(n_to_n["data"][1]["score"] - scores[DOCS[1]]) < TOLERANCE  # cosine is symmetric
    assert one_to_n["usage"]["prompt_tokens"] == sum(lengths[QUERY] + lengths[doc] for doc in DOCS)
    assert len(set(scores.values())) == len(DOCS)  # the order below is not a tie


async def test_rerank_sorts_by_relevance(app, want) -> None:
    scores, lengths = want
    best = sorted(DOCS, key=scores.__getitem__, reverse=True)
    documents = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]  # Jina's {"text": ...} objects too
    full = await _post(app, "/rerank", {"query": QUERY, "documents": documents})
    top = await _post(app, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False})
    assert [r["document"]["text"] for r in full["results"]] == best
    assert [r["index"] for r in full["results"]] == [DOCS.index(doc) for doc in best]
    assert all(abs(r["relevance_score"] - scores[r["document"]["text"]]) < TOLERANCE for r in full["results"])
    assert [r["index"] for r in top["results"]] == [DOCS.index(doc) for doc in best[:2]]
    assert all("document" not in r for r in top["results"])
    assert full["usage"]["total_tokens"] == sum(lengths[QUERY] + lengths[doc] for doc in DOCS)
    negative = await _post(app, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1})  # vLLM: top_n <= 0 is all
    assert [r["index"] for r in negative["results"]] == [r["index"] for r in full["results"]]


async def test_pooling_basics_user_and_request_id(app) -> None:
    """vLLM's pooling requests all take ``user`` (unused) and ``request_id`` (the response's id after its prefix)."""
    scored = await _post(app, "/v1/score", {"text_1": QUERY, "text_2": DOCS[0], "user": "u", "request_id": "s1"})
    reranked = await _post(app, "/v2/rerank", {"query": QUERY, "documents": DOCS[:1], "user": "u", "request_id": "r1"})
    assert (scored["id"], reranked["id"]) == ("score-s1", "rerank-r1")


@pytest.mark.parametrize("path, body, param", [
    ("/classify", {"input": "def add(a, b):"}, "model"),  # a generative model has no classification head
    ("/classify", {"messages": [{"role": "user", "content": "hi"}]}, "model"),  # chat messages too
    ("/v2/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": 1.5}, "top_n"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": False}, "use_activation"),
    # a type error names the field with its digit (not "text_")
    ("/score", {"text_1": [1, 2, 3], "text_2": "b"}, "text_1"),
    ("/score", {"text_1": "a", "text_2": 5}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", None]}, "text_2"),
    ("/classify", {"input": ""}, "input"),
])
async def test_bad_requests_are_400s_naming_the_field(app, path: str, body: dict, param: str) -> None:
    error = (await _post(app, path, body, status=400))["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


async def test_an_unknown_model_is_a_404(app) -> None:
    error = (await _post(app, "/score", {"model": "nope", "text_1": "a", "text_2": "b"}, status=404))["error"]
    assert error["code"] == "model_not_found"


async def test_context_length_errors_name_the_route_as_vllm(app, bundled_engine, bundled_tokenizer) -> None:
    """vLLM's word is the route's, whatever the model (a cross-encoder's: tests/engine/test_classification.py):
    /score "score", /rerank and /v1/embeddings "embedding generation"; so for a text with more characters than
    max_model_len tokens can spell, refused before it is tokenized whole (a generation's as any long prompt's)."""
    from asyncllm.engine.validation import max_prompt_chars

    length = bundled_engine.config.max_model_len
    long, huge = "a " * length, ("a " * length * 100)[:max_prompt_chars(bundled_tokenizer, length) + 1]
    tokens = f"{len(bundled_tokenizer(long).input_ids)} tokens"
    count = len(bundled_tokenizer(huge, add_special_tokens=False).input_ids)  # its one part (`tokens_at_least`)
    chars = f"{len(huge)} characters, at least {count} tokens"
    bodies = [("/score", {"text_1": long, "text_2": "b"}), ("/rerank", {"query": long, "documents": ["b"]}),
              ("/v1/embeddings", {"input": long}), ("/score", {"text_1": "b", "text_2": [huge]}),
              ("/v2/rerank", {"query": "b", "documents": [huge]}), ("/v1/embeddings", {"input": huge}),
              ("/v1/completions", {"prompt": huge})]
    errors = [(await _post(app, path, body, status=400))["error"] for path, body in bodies]
    said = [(f"you requested {tokens}", "score"), (f"you requested {tokens}", "embedding generation"),
            (f"you requested {tokens}", "embedding generation"), (f"you requested {chars}", "score"),
            (f"you requested {chars}", "embedding generation"), (f"you requested {chars}", "embedding generation")]
    want = [f"This model's maximum context length is {length} tokens. However, {amount} in the input for "
            f"{operation}. Please reduce the length of the input." for amount, operation in said]
    want.append(f"This model's maximum context length is {length} tokens. However, your request has {len(huge)} "
                f"characters, at least {count} input tokens. Please reduce the length of the input messages.")
    assert [error["message"] for error in errors] == want
    assert [(error["code"], error["param"]) for error in errors] == [("context_length_exceeded", "input_tokens")] * 7
