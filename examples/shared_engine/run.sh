#!/usr/bin/env bash
# One engine core, four uvicorn workers attached to it.
#   bash examples/shared_engine/run.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../.."

asyncllm engine "$@" &                  # loads the model once; listens on the default ipc:// address
core=$!
trap 'kill -TERM $core 2>/dev/null || true; wait $core 2>/dev/null || true' EXIT  # Ctrl-C may have ended it

# The workers attach at startup; a worker that starts before the core has bound its socket fails
# its startup, so wait for the core to answer first.
python -c "
import time
from asyncllm.engine.connect import default_address, handshake
for _ in range(600):
    try:
        handshake(default_address(), timeout_s=1.0); break
    except Exception:
        time.sleep(0.5)
"
# One port, four processes: each worker writes its metrics to this folder and any worker's /metrics
# serves the sum (prometheus_client's multiprocess mode). It must start empty.
export PROMETHEUS_MULTIPROC_DIR="$(mktemp -d)"
uvicorn examples.shared_engine.app:app --workers 4 --host 127.0.0.1 --port 8000
