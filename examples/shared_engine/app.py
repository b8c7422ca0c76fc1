"""`uvicorn --workers 4` whose worker processes share ONE engine core.

Each uvicorn worker is its own process with its own AsyncEngine that attaches
to the standalone core (`AsyncEngine.connect`): tokenization and
detokenization run in the workers, the model and the KV cache exist once, and
requests of all workers are batched together. See run.sh.
"""

from asyncllm import AsyncEngine
from asyncllm.integrations.openai_server import create_app

# Attaches at startup to `asyncllm engine` on its default address (pass the same --address to both).
# manage_engine: start (attach) with the worker, detach at shutdown; the core keeps running.
app = create_app(AsyncEngine.connect(disable_log_stats=True))
