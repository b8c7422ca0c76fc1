"""A tool-calling round trip with the official OpenAI client (run the server first).

    asyncllm serve --enable-auto-tool-choice --tool-call-parser hermes --structured-output-disable-any-whitespace &
    python examples/tool_calling.py

With a real chat model (Qwen3, Llama 3.1, ...) leave `tool_choice` out ("auto"):
the model decides to call the tool. The bundled tiny model never would, so this
example names the function, which constrains the reply to its arguments' schema.
`--structured-output-disable-any-whitespace` writes that JSON in the compact layout: by default (as vLLM's)
any JSON whitespace may come between its tokens, and the bundled model (trained on Python source, not on JSON:
docs/tiny-model.md) would write whitespace until `max_tokens` (a real model closes the JSON; drop the flag with one).
"""

import json

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
model = client.models.list().data[0].id

tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"]},
    },
}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

reply = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
call = reply.choices[0].message.tool_calls[0]
print("the model calls", call.function.name, call.function.arguments)

result = {"city": json.loads(call.function.arguments)["city"], "sky": "sunny", "celsius": 21}  # run the tool
messages += [reply.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none", max_tokens=32)
print("the model answers", answer.choices[0].message.content)
