"""Async views over the process's engine (made from settings.ASYNCLLM, started by the first request)."""

import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from asyncllm import AsyncLLMError, InvalidRequestError, SamplingParams
from asyncllm.integrations.django import error_response, get_engine, stream_response


@require_GET
async def complete(request: HttpRequest):
    """GET /complete?prompt=...: the completion, streamed as plain text."""
    max_tokens = request.GET.get("max_tokens", "64")
    if not max_tokens.isdigit():
        return error_response(InvalidRequestError("max_tokens", f"a whole number, got {max_tokens!r}"))
    params = SamplingParams(max_tokens=int(max_tokens), temperature=0.7)
    return await stream_response(get_engine().stream(request.GET.get("prompt", "def main():"), params), request)


@csrf_exempt
@require_POST
async def chat(request: HttpRequest):
    """POST /chat {"messages": [...]}: the whole reply as JSON."""
    try:
        messages = json.loads(request.body)["messages"]
    except (ValueError, KeyError, TypeError):
        return error_response(InvalidRequestError("messages", 'send a JSON object {"messages": [...]}'))
    try:
        text = "".join([d.text async for d in get_engine().chat(messages, SamplingParams(max_tokens=64))])
    except AsyncLLMError as exc:
        return error_response(exc)
    return JsonResponse({"role": "assistant", "content": text})
