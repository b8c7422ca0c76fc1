"""SyncEngine in a plain script: blocking calls, threads, a sync stream (also Celery tasks, notebooks).

    python examples/sync_script.py
"""

from concurrent.futures import ThreadPoolExecutor

from asyncllm import SamplingParams
from asyncllm.integrations.sync import SyncEngine

params = SamplingParams(max_tokens=32, temperature=0.0)

with SyncEngine() as engine:  # owns a private event loop thread; the bundled tiny model
    print(engine.generate("def fibonacci(n):", params).text)

    for delta in engine.stream("import os\n", params):  # a plain iterator; break aborts the request
        print(delta.text, end="", flush=True)
    print()

    with ThreadPoolExecutor(8) as pool:  # thread-safe: these 8 requests are batched together
        for out in pool.map(lambda i: engine.generate(f"x_{i} = ", params), range(8)):
            print(repr(out.text))
