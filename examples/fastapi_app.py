"""FastAPI: the same lifespan helper, and the engine as a dependency.

    pip install fastapi && uvicorn examples.fastapi_app:app
    curl -N -X POST 127.0.0.1:8000/complete -H 'content-type: application/json' -d '{"prompt": "import os"}'
"""

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.integrations.starlette import engine_lifespan, get_engine, text_stream_response

app = FastAPI(lifespan=engine_lifespan(AsyncEngine()))


class Completion(BaseModel):
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.7


@app.post("/complete")
async def complete(body: Completion, request: Request, engine: AsyncEngine = Depends(get_engine)):
    params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature)
    return text_stream_response(engine.stream(body.prompt, params), request)
