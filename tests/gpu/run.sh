#!/usr/bin/env bash
# The GPU run: kernel, model and engine tests on CUDA, then the benchmarks, in priority order
# under one deadline. Each step logs to <step>.log and the run goes on when one fails; at the end
# OUT_DIR holds summary.txt and gpu_run.tgz (every log, and bench/out).
# Usage (repository root, packages importable, the default model installed):
#   tests/gpu/run.sh OUT_DIR [SECONDS]     # tests/gpu/README.md says how a GPU run is made
set -uo pipefail
OUT=${1:?output folder}; BUDGET=${2:-540}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
DEADLINE=$(( $(date +%s) + BUDGET ))
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 DEEPINFER_TEST_DEVICE=cuda

step() {  # step NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2; shift 2
  [[ " ${SKIP:-} " == *" $name "* ]] && return  # SKIP="kernel_tests ...": steps already run
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < 20 )) && { echo "== $name: skipped, ${left}s left" | tee -a "$OUT/summary.txt"; return; }
  (( cap > left )) && cap=$left
  local t0=$(date +%s)
  timeout -k 5 "$cap" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s (cap ${cap}s)" | tee -a "$OUT/summary.txt"
  tail -n 25 "$LOGS/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/summary.txt"

KERNEL_TESTS=(tests/kernels/attention/test_{kv_store,paged_attention}_kernel.py
  tests/kernels/elementwise/test_{norm,rotary}_kernel.py tests/kernels/linear/test_matmul_kernel.py)
step kernel_tests 150 python3 -m pytest -q -rs -p no:cacheprovider "${KERNEL_TESTS[@]}"
CUDA_TESTS=${CUDA_TESTS:-tests/gpu tests/model/test_gguf_smollm2.py \
  tests/tiers/host/test_engine_host_cache.py tests/sampling/test_sampler.py \
  tests/engine/models/test_real.py tests/engine/test_disagg.py \
  tests/engine/test_device_groups.py tests/kv_transfer/test_pull.py \
  tests/engine/models/test_batch_invariant.py::test_batch_invariant_bits_on_cuda}
# shellcheck disable=SC2086  # a list of paths
step cuda_tests 300 python3 -m pytest -q -rs -p no:cacheprovider $CUDA_TESTS
step interference 240 python3 bench/interference.py --modes disagg,colocated \
  --baseline-s "${BASELINE_S:-10}" \
  "--deepinfer-args=--device cuda"
step serve 180 python3 bench/serve.py --skip-llama --levels 32,64,128,256 \
  "--deepinfer-args=--device cuda --max-num-seqs 256"
step serving_path 120 python3 bench/serving_path.py --clients 32 128 256
step decode_step 120 python3 -m bench.decode_step --device cuda --dtype bfloat16 \
  --batch 1 8 32 64 --steps 20 --warmup 3
step kernels_bench 120 python3 -m bench.kernels
mkdir -p bench/out && cp "$OUT/summary.txt" "$LOGS/" && cp -r bench/out "$LOGS/bench_out"
tar czf "$OUT/gpu_run.tgz" -C "$LOGS" .
