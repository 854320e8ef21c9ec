#!/usr/bin/env bash
# The GPU check, one call of at most 8 minutes on a lent GPU machine (docs/gpu.md; the
# targets at the end are set for an NVIDIA H200):
#   1. token identity with transformers on CUDA for tiny random Llama / Qwen2 models
#      (float32), CUDA-graph greedy == eager, the Triton paged-decode kernel against its
#      reference, the KV-cache / scheduler / sampler unit tests;
#   2. the bench on the SmolLM2-135M architecture with random weights (the real weights
#      cannot travel to that machine; with EOS ignored, speed depends on shapes only):
#      engine@1 and engine@64 against transformers' continuous batching on 64 requests,
#      then engine@256 on 1,024 requests; merged into $OUT/bench_gpu_h200.json (copy it to
#      assets/), with the targets checked at the end;
#   3. the host overhead per step with the stand-in model on this machine's CPU and GPU.
#
# Before the call, on the development machine (once): `scripts/gpu_run.sh --prepare`
# copies the bundled model's config.json and tokenizer files into .gpu/smollm2/ (ignored
# by git, ~3.5 MB): pass `.gpu` in the run's carry list.
set -uo pipefail
if [[ "${1:-}" == "--prepare" ]]; then
  src=$(.venv/bin/python -c "from engine.models import loader
print(loader.hf_folder(loader.resolve_model(None)))") || exit 1
  mkdir -p .gpu/smollm2
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
           special_tokens_map.json chat_template.jinja; do
    [[ -f "$src/$f" ]] && cp "$src/$f" .gpu/smollm2/
  done
  ls -la .gpu/smollm2
  exit 0
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
T0=$SECONDS
[[ -f .gpu/smollm2/config.json ]] || { echo "missing .gpu/smollm2: run scripts/gpu_run.sh --prepare here and carry .gpu"; exit 2; }
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
timeout 60 python3 scripts/random_model.py .gpu/smollm2 /tmp/smollm2-random

echo "== tests on CUDA ($((SECONDS - T0)) s)"
export BATCHLENS_TEST_DEVICE=cuda BATCHLENS_TOKENIZER_DIR=.gpu/smollm2
timeout 170 python3 -m pytest -q -p no:cacheprovider \
  "tests/engine/test_engine_correctness.py::test_tiny_random_models_match" \
  "tests/engine/test_padded_decode.py::test_padded_decode_greedy_equals_eager_and_transformers" \
  tests/engine/test_paged_decode.py tests/engine/test_kv_cache.py tests/engine/test_scheduler.py \
  tests/engine/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|Error" | tail -15
unset BATCHLENS_TEST_DEVICE

echo "== bench, 64 requests: engine@1, engine@64, hf_continuous ($((SECONDS - T0)) s)"
timeout 170 python3 -m measure.bench --model /tmp/smollm2-random --device cuda \
  --only engine,hf_continuous --concurrency 1,64 --requests 64 \
  --json "$OUT/gpu_bench_64.json" 2>&1 | tee "$OUT/gpu_bench_64.txt" | grep -v "^  engine@"
echo "== bench, 1,024 requests: engine@256 ($((SECONDS - T0)) s)"
timeout 100 python3 -m measure.bench --model /tmp/smollm2-random --device cuda \
  --only engine --concurrency 256 --requests 1024 \
  --json "$OUT/gpu_bench_1024.json" 2>&1 | tee "$OUT/gpu_bench_1024.txt" | grep -v "^  engine@"

echo "== merged JSON and the targets ($((SECONDS - T0)) s)"
python3 - "$OUT" <<'EOF'
import datetime, json, os, sys
import torch
out = sys.argv[1]
docs = []
for name in ("gpu_bench_64.json", "gpu_bench_1024.json"):
    path = os.path.join(out, name)
    if os.path.exists(path):
        docs.append(json.load(open(path)))
if not docs:
    sys.exit("no bench JSON was written")
runs = {}
for d in docs:
    for run, r in d["runs"].items():
        runs[run] = {**r, "requests": d["requests"]}
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
merged = {**docs[0], "runs": runs, "requests": [d["requests"] for d in docs],
          "complete": all(d.get("complete") for d in docs), "ratios": {},
          "note": f"{gpu}, torch {torch.__version__}, "
                  f"{datetime.date.today()}; scripts/gpu_run.sh: SmolLM2-135M architecture with "
                  "random weights; engine@1, engine@64 and hf_continuous on 64 requests, "
                  "engine@256 on 1,024 requests (each run's 'requests')"}
tput = {n: r["summary"]["throughput"] for n, r in runs.items() if r.get("summary")}
if "engine@64" in tput and "hf_continuous" in tput:
    merged["ratios"]["engine@64 / hf_continuous"] = tput["engine@64"] / tput["hf_continuous"]
json.dump(merged, open(os.path.join(out, "bench_gpu_h200.json"), "w"), indent=2)
checks = [("engine@256 >= 20,000 tok/s", tput.get("engine@256", 0) >= 20000),
          ("engine@1 >= 300 tok/s", tput.get("engine@1", 0) >= 300),
          ("engine@64 >= 5x hf_continuous",
           merged["ratios"].get("engine@64 / hf_continuous", 0) >= 5)]
for n in ("engine@1", "engine@64", "engine@256", "hf_continuous"):
    print(f"{n:>14}: {tput[n]:,.0f} tok/s" if n in tput else f"{n:>14}: n/a")
for text, ok in checks:
    print(f"target {text}: {'PASS' if ok else 'FAIL'}")
EOF
python3 -m measure.bench --report "$OUT/bench_gpu_h200.json" 2>&1 | tail -12

echo "== host overhead per step, stand-in model ($((SECONDS - T0)) s)"
timeout 60 python3 -m measure.bench --host-overhead --model /tmp/smollm2-random --device cpu \
  --dtype float32 --json "$OUT/host_overhead_h200_cpu.json" 2>&1 | tail -7
timeout 60 python3 -m measure.bench --host-overhead --model /tmp/smollm2-random --device cuda \
  --json "$OUT/host_overhead_h200_cuda.json" 2>&1 | tail -7
echo "== done in $((SECONDS - T0)) s"
