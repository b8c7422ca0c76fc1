"""Starlette: the engine starts with the app; a route streams text; the OpenAI API is mounted too.

    uvicorn examples.starlette_app:app
    curl -N 'http://127.0.0.1:8000/complete?prompt=def%20main():'
"""

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount, Route

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.integrations.openai_server import create_app
from asyncllm.integrations.starlette import engine_lifespan, get_engine, text_stream_response

engine = AsyncEngine()  # the bundled tiny model; pass a folder or hub id for a real one


async def complete(request: Request):
    prompt = request.query_params.get("prompt", "def main():")
    stream = get_engine(request).stream(prompt, SamplingParams(max_tokens=64, temperature=0.7))
    return text_stream_response(stream, request)  # a client that hangs up aborts the request


app = Starlette(
    routes=[
        Route("/complete", complete),
        Mount("/openai", create_app(engine, manage_engine=False)),  # /openai/v1/chat/completions, ...
    ],
    lifespan=engine_lifespan(engine),
)
