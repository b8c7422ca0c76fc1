"""A ``Qwen3ForSequenceClassification`` cross-encoder (one label) over two tensor-parallel ranks: `classify` logits
equal transformers' in chunked batches with prefix-cache hits, `score` reads each pair as transformers'
``tokenizer(text_1, text_2)`` and answers the sigmoid of its logit (1:1, 1:N, N:N); refusals are typed and named;
the server's /classify, /score and /rerank over this engine (one engine for all: engine starts are the cost).
Three labels (softmax) in the runner: tests/unit/test_classifier.py; the cosine scores of embedding models:
tests/integrations/test_openai_score.py."""

from __future__ import annotations

import asyncio
import math

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, PoolingParams
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client
from classifier_utils import hf_classifier_logits, hf_token_classifier_logits, tiny_classifier
from engine_helpers import random_prompts

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOLERANCE = 1e-5
"""float32 logits against transformers' (two ranks sum their attention and MLP shares in another order)."""


@pytest.fixture(scope="module")
def reranker(tiny_qwen3: str, tmp_path_factory) -> str:
    return tiny_classifier(tiny_qwen3, str(tmp_path_factory.mktemp("qwen3-reranker")), num_labels=1, seed=3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(reranker: str):
    async with AsyncEngine(reranker, tensor_parallel_size=2, max_num_batched_tokens=24,
                           disable_log_stats=True) as engine:
        yield engine


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


async def test_classify_equals_transformers_in_chunked_batches(engine: AsyncEngine, reranker: str) -> None:
    prompts = random_prompts(5, seed=7, stem_len=40, max_len=70)  # every other one shares a 40-token stem
    outs = await asyncio.gather(*(engine.classify(prompt) for prompt in prompts))
    again = await engine.classify(prompts[1])  # its stem is cached now: a prefix hit
    for prompt, out in zip([*prompts, prompts[1]], [*outs, again]):
        want = hf_classifier_logits(reranker, prompt)
        assert out.prompt_token_ids == prompt and out.num_classes == 1 and out.label == "class_0"
        assert abs(out.logits[0] - want[0]) < TOLERANCE, (out.logits, want)
        assert abs(out.probs[0] - _sigmoid(out.logits[0])) < 1e-12
    assert again.num_cached_tokens >= 32 and again.outputs.probs == again.probs  # vLLM's spelling too
    assert len({round(out.logits[0], 4) for out in outs}) == len(outs)  # the head tells the prompts apart


async def test_score_reads_each_pair_as_one_prompt(engine: AsyncEngine, reranker: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reranker)
    query, docs = "how do I sort a list?", ["sorted(items)", "import os", "list.sort() sorts in place"]
    one_to_n = await engine.score(query, docs)
    one_to_one = await engine.score(query, docs[2])
    n_to_n = await engine.score([docs[0], query], [query, docs[1]])
    pairs = [*((query, doc) for doc in docs), (query, docs[2]), (docs[0], query), (query, docs[1])]
    for (text_1, text_2), out in zip(pairs, [*one_to_n, *one_to_one, *n_to_n]):
        ids = tokenizer(text_1, text_2).input_ids
        assert out.prompt_token_ids == ids
        assert abs(out.score - _sigmoid(hf_classifier_logits(reranker, ids)[0])) < TOLERANCE
    assert len(one_to_n) == 3 and len(one_to_one) == 1 and len(n_to_n) == 2
    assert one_to_one[0].outputs.score == one_to_one[0].score  # vLLM's ScoringRequestOutput.outputs.score


async def test_refusals_name_the_field(engine: AsyncEngine) -> None:
    length = engine.config.max_model_len  # a prompt may fill it (a pooling request generates nothing); not pass it
    cases = [
        (engine.classify([5] * (length + 1)), "prompt", f"you requested {length + 1} tokens in the input for "
                                                        "classification"),
        (engine.score("a " * length, "b"), "prompt", "tokens in the input for score"),  # the pair: one prompt
        (engine.generate([5, 9, 14]), "prompt", "classification and scores only"),
        (engine.embed([5, 9, 14]), "model", "classification and scores only"),
        (engine.score(["a", "b"], ["c", "d", "e"]), "text_2", "1:N"),
        (engine.score([], "c"), "text_1", "non-empty list"),
        (engine.score("a", ["c", ""]), "text_2", "empty text"),
        (engine.score("a", [3, 4]), "text_2", "list of str"),
        (engine.embed([5, 9], PoolingParams(task="rerank")), "task", "embed, classify"),
    ]
    for call, field, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as info:
            await call
        assert info.value.field == field
        assert info.value.code == ("context_length_exceeded" if "maximum context length" in info.value.message else None)
    assert engine.stats().num_requests_running == 0


async def test_the_server_classifies_scores_and_reranks(engine: AsyncEngine, reranker: str) -> None:
    query, docs = "how do I sort a list?", ["import os", "sorted(items)", "list.sort() sorts in place"]
    want = {doc: (await engine.score(query, doc))[0].score for doc in docs}  # checked against transformers above
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        classified = (await client.post("/classify", json={"input": [[5, 9, 14], [7, 300, 12]]})).json()
        scored = (await client.post("/v1/score", json={"text_1": query, "text_2": docs})).json()
        reranked = (await client.post("/v2/rerank", json={"query": query, "documents": docs, "top_n": 2})).json()
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        embedded = await client.post("/v1/embeddings", json={"input": "hi"})
    for i, prompt in enumerate([[5, 9, 14], [7, 300, 12]]):
        item = classified["data"][i]
        assert (item["index"], item["label"], item["num_classes"]) == (i, "class_0", 1)
        assert abs(item["probs"][0] - _sigmoid(hf_classifier_logits(reranker, prompt)[0])) < TOLERANCE
    assert classified["usage"]["prompt_tokens"] == 6
    assert all(abs(d["score"] - want[doc]) < TOLERANCE for d, doc in zip(scored["data"], docs))  # another batch
    assert scored["usage"]["prompt_tokens"] == sum(len(out.prompt_token_ids) for out in await engine.score(query, docs))
    best = sorted(docs, key=want.__getitem__, reverse=True)[:2]
    assert min(abs(a - b) for a in want.values() for b in want.values() if a != b) > 1e-3  # no near tie
    assert [r["document"]["text"] for r in reranked["results"]] == best
    assert all(abs(r["relevance_score"] - want[doc]) < TOLERANCE for r, doc in zip(reranked["results"], best))
    assert [r["index"] for r in reranked["results"]] == [docs.index(doc) for doc in best]
    for response in (chat, embedded):
        assert response.status_code == 400 and "classification and scores only" in response.json()["error"]["message"]


async def test_activation_switches_and_sagemaker_invocations(engine: AsyncEngine, reranker: str) -> None:
    """vLLM's ``use_activation`` (and its older ``softmax`` / ``activation``) on /classify, /score and /rerank: false
    gives the raw logits; SageMaker's /invocations routes ``input`` to /classify on a classifier, ``text_1`` /
    ``text_2`` to /score and ``query`` / ``documents`` to /rerank."""
    query, docs, prompt = "how do I sort a list?", ["sorted(items)", "import os"], [5, 9, 14]
    logit = hf_classifier_logits(reranker, prompt)[0]
    raw = {doc: (await engine.score(query, doc, use_activation=False))[0].score for doc in docs}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        classified = [(await client.post(path, json={"input": [prompt], **switch})).json()["data"][0]["probs"][0]
                      for path, switch in (("/classify", {"use_activation": False}), ("/classify", {"softmax": False}),
                                           ("/invocations", {}))]
        scored = (await client.post("/invocations", json={"text_1": query, "text_2": docs, "activation": False})).json()
        reranked = (await client.post("/invocations", json={"query": query, "documents": docs,
                                                            "use_activation": False})).json()
    assert abs(classified[0] - logit) < TOLERANCE and abs(classified[1] - logit) < TOLERANCE
    assert abs(classified[2] - _sigmoid(logit)) < TOLERANCE
    assert all(abs(raw[doc] - d["score"]) < TOLERANCE for d, doc in zip(scored["data"], docs))
    assert all(abs(r["relevance_score"] - raw[docs[r["index"]]]) < TOLERANCE for r in reranked["results"])
    assert abs((await engine.score(query, docs[0]))[0].score - _sigmoid(raw[docs[0]])) < TOLERANCE


async def test_the_servers_pooling_route(engine: AsyncEngine, reranker: str) -> None:
    """vLLM's /pooling on a classifier: its own task (classify) gives /classify's probs, ``use_activation`` false (or
    vLLM's older ``softmax``) the raw logits, ``score`` the cross-encoder's activation, chat ``messages`` classified
    as the template renders them; another model's task, a per-token task, another task's parameter are 400s naming
    the field, a context-length error says "embedding generation" (vLLM's /pooling, whatever the task), an empty
    input names the task served."""
    from transformers import AutoTokenizer

    prompts, messages = [[5, 9, 14], [7, 300, 12]], [{"role": "user", "content": "hi"}]
    length = engine.config.max_model_len
    refused = [({"input": "a", "task": "embed"}, "task", "Task embed is not supported, it must be one of ('classify', "
                                                         "'score', 'token_classify')."),
               ({"input": "a", "task": "token_classify", "normalize": True}, "normalize",
                "Task token_classify only supports ['use_activation']"),
               ({"input": "a", "normalize": True}, "normalize", "Task classify only supports ['use_activation']"),
               ({"input": "a", "task": "score", "dimensions": 4}, "dimensions", "Task score only supports"),
               ({"input": [5] * (length + 1)}, "input_tokens", "in the input for embedding generation."),
               ({"input": ""}, "input", "an input is an empty string: there is nothing to classify"),
               ({"input": ["a", ""], "task": "score"}, "input", "there is nothing to score")]
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        classified = (await client.post("/classify", json={"input": prompts})).json()
        pooled, raw, old_name, scored, chat = [(await client.post("/pooling", json=body)).json() for body in (
            {"input": prompts}, {"input": prompts, "task": "classify", "use_activation": False},
            {"input": prompts[0], "softmax": False}, {"input": prompts, "task": "score"}, {"messages": messages})]
        errors = [(await client.post("/pooling", json=body)).json()["error"] for body, _, _ in refused]
    assert [item["object"] for item in pooled["data"]] == ["pooling", "pooling"] and pooled["id"].startswith("pool-")
    assert pooled["usage"] == classified["usage"]
    for i, prompt in enumerate(prompts):
        logits = hf_classifier_logits(reranker, prompt)
        assert abs(raw["data"][i]["data"][0] - logits[0]) < TOLERANCE
        assert abs(pooled["data"][i]["data"][0] - classified["data"][i]["probs"][0]) < TOLERANCE
        assert abs(scored["data"][i]["data"][0] - _sigmoid(logits[0])) < TOLERANCE
    assert abs(old_name["data"][0]["data"][0] - raw["data"][0]["data"][0]) < TOLERANCE  # another batch
    ids = AutoTokenizer.from_pretrained(reranker).apply_chat_template(messages, tokenize=True, return_dict=False)
    assert abs(chat["data"][0]["data"][0] - _sigmoid(hf_classifier_logits(reranker, list(ids))[0])) < TOLERANCE
    assert chat["usage"]["prompt_tokens"] == len(ids)
    for error, (_, param, message) in zip(errors, refused):
        assert error["param"] == param and message in error["message"], error


async def test_token_classify_is_the_score_head_on_every_prompt_token(engine: AsyncEngine, reranker: str) -> None:
    """vLLM's ``token_classify`` (ALL pooling through the score head): every prompt token's logits as transformers'
    classifier computes them before it takes the last, across 24-token chunks, no prefix-cache hit (a classification
    cached the prompt's first blocks), through classify's activation unless ``use_activation`` false; the server's
    /pooling gives the same rows."""
    prompt = [3 + (41 * i) % 480 for i in range(50)]
    first = await engine.classify(prompt[:40])  # its blocks enter the cache
    probs, raw = await asyncio.gather(engine.encode(prompt, pooling_task="token_classify"),
                                      engine.encode(prompt, PoolingParams(use_activation=False),
                                                    pooling_task="token_classify"))
    want = hf_token_classifier_logits(reranker, prompt)
    assert len(raw.data) == len(prompt) == len(want) and raw.num_cached_tokens == probs.num_cached_tokens == 0
    assert max(abs(got[0] - row[0]) for got, row in zip(raw.data, want)) < TOLERANCE
    assert max(abs(got[0] - _sigmoid(row[0])) for got, row in zip(probs.data, raw.data)) < TOLERANCE
    assert abs(raw.data[39][0] - first.logits[0]) < TOLERANCE  # the prefix's last row is its classification
    assert await engine.get_supported_tasks() == ("classify", "score", "token_classify")
    for kwargs, field in [({"pooling_params": PoolingParams(normalize=True)}, "normalize"),
                          ({"pooling_params": PoolingParams(dimensions=1)}, "dimensions")]:
        with pytest.raises(InvalidRequestError) as info:
            await engine.encode(prompt, pooling_task="token_classify", **kwargs)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="serves classification and scores only") as info:
        await engine.encode(prompt, pooling_task="token_embed")
    assert info.value.field == "model"
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        served = (await client.post("/pooling", json={"input": prompt, "task": "token_classify",
                                                      "use_activation": False})).json()
    assert max(abs(a[0] - b[0]) for a, b in zip(served["data"][0]["data"], raw.data)) < TOLERANCE


async def test_the_server_classifies_chat_messages(engine: AsyncEngine, reranker: str) -> None:
    """vLLM's ClassificationChatRequest: /classify's ``messages`` rendered with the chat template
    (``add_generation_prompt`` false unless sent), as /pooling's are, ``request_id`` naming the response; a chat field
    with ``input``, both or neither of ``input`` and ``messages``, a template from a request the server does not
    trust are 400s naming the field; a chat past max_model_len names ``input_tokens`` and says "classification"."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "is this a good day?"}, {"role": "assistant", "content": "yes"}]
    tokenizer = AutoTokenizer.from_pretrained(reranker)
    plain = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    opened = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True))
    length = engine.config.max_model_len
    refused = [({"input": "a", "add_generation_prompt": True}, "add_generation_prompt"),
               ({"input": "a", "messages": messages}, "input"), ({}, "input"),
               ({"messages": messages, "chat_template": "{{ 1 }}"}, "chat_template"),
               ({"messages": messages, "add_generation_prompt": True, "continue_final_message": True},
                "continue_final_message"),
               ({"messages": [{"role": "user", "content": "a " * length}]}, "input_tokens")]
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        chat, opened_chat, raw, pooled = [(await client.post(path, json=body)).json() for path, body in (
            ("/classify", {"messages": messages, "request_id": "c1"}),
            ("/classify", {"messages": messages, "add_generation_prompt": True}),
            ("/classify", {"messages": messages, "use_activation": False}), ("/pooling", {"messages": messages}))]
        errors = [(await client.post("/classify", json=body)).json()["error"] for body, _ in refused]
    logit = hf_classifier_logits(reranker, plain)[0]
    item = chat["data"][0]
    assert (item["index"], item["label"], chat["usage"]["prompt_tokens"]) == (0, "class_0", len(plain))
    assert chat["id"] == "classify-c1" and abs(item["probs"][0] - _sigmoid(logit)) < TOLERANCE
    assert abs(pooled["data"][0]["data"][0] - item["probs"][0]) < TOLERANCE
    assert abs(raw["data"][0]["probs"][0] - logit) < TOLERANCE
    assert abs(opened_chat["data"][0]["probs"][0] - _sigmoid(hf_classifier_logits(reranker, opened)[0])) < TOLERANCE
    assert opened_chat["usage"]["prompt_tokens"] == len(opened) != len(plain)
    assert [error["param"] for error in errors] == [param for _, param in refused], errors
    assert "in the input for classification" in errors[-1]["message"]


async def test_the_server_names_the_route_in_context_length_errors(engine: AsyncEngine, reranker: str) -> None:
    """vLLM's word is the route's, whatever the model (an embedding model's: tests/integrations/test_openai_score.py):
    /score "score", /rerank "embedding generation" on a cross-encoder too, /classify "classification"; so for a
    pair with more characters than max_model_len tokens can spell, refused before it is tokenized whole."""
    from transformers import AutoTokenizer

    from asyncllm.engine.validation import max_prompt_chars

    tokenizer, length = AutoTokenizer.from_pretrained(reranker), engine.config.max_model_len
    long, huge = "a " * length, ("a " * length * 100)[:max_prompt_chars(tokenizer, length)]  # + "b": one too many
    tokens = f"{len(tokenizer(long, 'b').input_ids)} tokens"
    chars = f"{len(huge) + 1} characters, at least {len(tokenizer(huge, add_special_tokens=False).input_ids)} tokens"
    bodies = [("/score", {"text_1": long, "text_2": "b"}), ("/rerank", {"query": long, "documents": ["b"]}),
              ("/classify", {"input": [5] * (length + 1)}), ("/v1/score", {"text_1": huge, "text_2": "b"}),
              ("/v1/rerank", {"query": huge, "documents": ["b"]})]
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        errors = [(await client.post(path, json=body)).json()["error"] for path, body in bodies]
    said = [(tokens, "score"), (tokens, "embedding generation"), (f"{length + 1} tokens", "classification"),
            (chars, "score"), (chars, "embedding generation")]
    assert [error["message"] for error in errors] == [
        f"This model's maximum context length is {length} tokens. However, you requested {amount} in the input for "
        f"{operation}. Please reduce the length of the input." for amount, operation in said]
    assert all((error["code"], error["param"]) == ("context_length_exceeded", "input_tokens") for error in errors)


async def test_the_server_logs_each_input_and_pair(engine: AsyncEngine, caplog) -> None:
    """vLLM's request log: /classify each input as ``classify-ID-i`` (ID the X-Request-Id header, the response's
    id), a cross-encoder's /score and /rerank each pair as ``text_1`` + the tokenizer's sep token + ``text_2``."""
    import logging

    from asyncllm.integrations.openai_request_log import RequestLogger

    caplog.set_level(logging.DEBUG, logger="asyncllm.integrations.openai.requests")
    async with asgi_client(create_app(engine, manage_engine=False, request_logger=RequestLogger())) as client:
        classified = await client.post("/classify", json={"input": ["a", "b"]}, headers={"X-Request-Id": "c"})
        scored = (await client.post("/score", json={"text_1": "q", "text_2": ["x", "y"]})).json()
        reranked = (await client.post("/rerank", json={"query": "q", "documents": ["z"]})).json()
    sep = engine.tokenizer.sep_token or ""
    assert classified.json()["id"] == "classify-c"
    assert [r.getMessage().split(", prompt_embeds")[0] for r in caplog.records if r.levelname == "DEBUG"] == [
        "Request classify-c-0 details: prompt: 'a', prompt_token_ids: None",
        "Request classify-c-1 details: prompt: 'b', prompt_token_ids: None",
        f"Request {scored['id']}-0 details: prompt: {'q' + sep + 'x'!r}, prompt_token_ids: None",
        f"Request {scored['id']}-1 details: prompt: {'q' + sep + 'y'!r}, prompt_token_ids: None",
        f"Request {reranked['id']}-0 details: prompt: {'q' + sep + 'z'!r}, prompt_token_ids: None"]
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == 5 and all("params: PoolingParams(" in line and "task='classify'" in line for line in infos)
