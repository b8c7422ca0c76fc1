"""aiohttp: the engine starts and stops with the app; a handler streams the text.

    python examples/aiohttp_app.py
    curl -N -X POST 127.0.0.1:8080/generate -d '{"prompt": "class A:", "max_tokens": 48}'
    curl -N '127.0.0.1:8080/complete?prompt=import%20os'
"""

from aiohttp import web

from asyncllm import SamplingParams
from asyncllm.integrations.aiohttp import ENGINE_KEY, create_app, stream_text


async def complete(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    stream = engine.stream(request.query.get("prompt", "def main():"), SamplingParams(max_tokens=64))
    return await stream_text(request, stream)


app = create_app()  # the bundled tiny model, with POST /generate; pass AsyncEngine(...) for another
app.router.add_get("/complete", complete)

if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=8080)
