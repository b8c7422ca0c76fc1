"""asyncllm.integrations: the engine in other people's frameworks.

- `openai_server`: an OpenAI-compatible ASGI app (``asyncllm serve``)
- `starlette`: lifespan helper and streaming response for Starlette / FastAPI
- `aiohttp`: app factory, `setup_engine`, streaming handler
- `django`: lazy per-process engine and `StreamingHttpResponse` helper
- `sync`: `SyncEngine`, a blocking facade for Celery, scripts and notebooks

Each module imports its framework, so import the one you use; docs/integrations/
has a page per module.
"""
