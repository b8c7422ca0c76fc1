"""The official OpenAI client against `asyncllm serve` (run `asyncllm serve` first).

    asyncllm serve &            # the bundled tiny model on http://127.0.0.1:8000
    python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # any key unless --api-key is set
model = client.models.list().data[0].id

completion = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=48, temperature=0)
print(completion.choices[0].text)
print(completion.usage)

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Write a loop"}], max_tokens=48, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    elif chunk.usage:
        print(f"\n{chunk.usage}")
