#!/bin/bash
# The GPU session's device command (docs/benchmarks.md): run from the repository root on the device, with the
# wheels of .whl carried. env: TEST_STEPS / BENCH_STEPS (gpu_session step names), TEST_BUDGET / BENCH_BUDGET (s).
# Tests run with the carried transformers (CI's version); benchmarks with the image's (the peer of benchmarks.md).
mkdir -p /tmp/site /tmp/site_tf
for w in .whl/*.whl; do
  case "$w" in *transformers*|*huggingface_hub*|*tokenizers*) t=/tmp/site_tf;; *) t=/tmp/site;; esac
  python3 -m pip install -q --no-index --no-deps --target $t "$w" 2>&1 | grep -v WARNING | tail -2
done
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TF=/tmp/site_tf:/tmp/site
if ! PYTHONPATH=$TF python3 -c "import transformers, tokenizers, huggingface_hub; from transformers import Qwen3Config; print('carried transformers', transformers.__version__, 'hub', huggingface_hub.__version__)"; then
  TF=/tmp/site; echo "FALLBACK: tests with the image's transformers"
fi
python3 -c "import transformers; print('image transformers', transformers.__version__)"
if [ -n "$TEST_STEPS" ]; then
  args=(); for s in $TEST_STEPS; do args+=(--only "$s"); done
  PYTHONPATH=$TF PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m asyncllm.bench.gpu_session --out "$OUT/tests" --budget-s "${TEST_BUDGET:-300}" "${args[@]}"
fi
if [ -n "$BENCH_STEPS" ]; then
  args=(); for s in $BENCH_STEPS; do args+=(--only "$s"); done
  PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 -m asyncllm.bench.gpu_session --out "$OUT/bench" --budget-s "${BENCH_BUDGET:-200}" "${args[@]}"
fi
