#!/usr/bin/env bash
# The GPU check, as run on the lent H200 machine (see README "GPU"):
#   1. engine vs transformers token identity on CUDA (tiny random Llama and Qwen2, float32),
#      plus the KV-cache / scheduler unit tests;
#   2. the benchmark on the SmolLM2-135M architecture with random weights (the real
#      weights cannot travel to that machine; with EOS ignored, speed depends on shapes only).
# Needs: .gpu/smollm2/ holding the bundled model's config.json and tokenizer files.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 scripts/random_model.py .gpu/smollm2 /tmp/smollm2-random
export BATCHLENS_TEST_DEVICE=cuda BATCHLENS_TOKENIZER_DIR=.gpu/smollm2
{ timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_engine_correctness.py -k tiny
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_scheduler.py
} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error"
# slowest run last: if the time limit cuts it, the JSON written after each run keeps the rest
timeout "${BENCH_TIMEOUT:-420}" python3 -m measure.bench --model /tmp/smollm2-random --device cuda \
  --only engine,local,hf_static,hf_continuous,hf_batch1 \
  --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
