"""One engine over the bundled tiny model, shared by every integration test on the session loop.

Integration modules mark themselves ``pytest.mark.asyncio(loop_scope="session")``
so they all reach this engine (an engine belongs to the loop it started on);
that keeps the engine starts of tests/integrations to a handful.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def bundled_engine():
    # compact JSON: under vLLM's default any-whitespace grammar the random bundled model writes whitespace without end
    engine = AsyncEngine(disable_log_stats=True, max_num_seqs=16, structured_output_disable_any_whitespace=True,
                         hf_overrides={"is_matryoshka": True})  # /v1/embeddings' `dimensions` (vLLM's switch)
    async with engine:
        yield engine


@pytest.fixture(scope="session")
def bundled_tokenizer():
    from transformers import AutoTokenizer

    from asyncllm.bundled import bundled_model_path

    return AutoTokenizer.from_pretrained(bundled_model_path())


@pytest.fixture(scope="module")
def app(bundled_engine):
    """The OpenAI-compatible app over the shared engine (the engine outlives it)."""
    from asyncllm.integrations.openai_server import create_app

    return create_app(bundled_engine, manage_engine=False)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def base_url(bundled_engine):
    """uvicorn serving the app over the shared engine on a free port, as a task of the session loop."""
    import uvicorn

    from asyncllm.integrations.openai_server import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(bundled_engine, manage_engine=False), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task
