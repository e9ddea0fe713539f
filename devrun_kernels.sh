#!/usr/bin/env bash
# Issue 51, kernel helper's GPU checks, for the lead to run on the device from the repo root:
#     bash devrun_kernels.sh          (logs under $OUT; under 240 s in all)
# 1. the CUDA tests of the W8A16 GEMM, the FP8 layer and the fused-quantization layer path;
# 2. the W8A16 micro-benchmark (python -m nanoinfer.bench.fp8 --w8a16): old few-row path against
#    W8A16 at the chosen and at every candidate config, M 1-128, Qwen3-8B projections, per channel;
# 3. the one-row GEMV's split-K against the plain GEMV at the 30B-A3B shapes, if time is left.
# Each step has its own time limit, and prints as it goes: a step cut short still leaves its log.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/devrun_kernels}
mkdir -p "$OUT"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

timeout 80 python -m pytest -q -p no:randomly -m cuda tests/test_fp8_skinny_gemm.py tests/test_fp8_prologue_quant.py \
    tests/test_quant_fp8.py::test_cuda_fp8_linear_matches_dequantized_reference \
    tests/test_quant_fp8.py::test_cuda_activation_quant_kernel 2>&1 | tail -25 > "$OUT/tests.log"
echo "tests: rc ${PIPESTATUS[0]} after $((SECONDS - start)) s"; tail -3 "$OUT/tests.log"

left=$((225 - (SECONDS - start)))
if [ -n "$(python -c 'import nanoinfer.bench.gemv as g; print(getattr(g, "compare_split_k", ""))' 2>/dev/null)" ]; then
    left=$((left - 45))
fi
timeout $left python -m nanoinfer.bench.fp8 --w8a16 > "$OUT/bench_fp8_w8a16.log" 2>&1
echo "bench.fp8 --w8a16: rc $? after $((SECONDS - start)) s"
grep -E "^copy|beats|^== 3" "$OUT/bench_fp8_w8a16.log"

if [ -n "$(python -c 'import nanoinfer.bench.gemv as g; print(getattr(g, "compare_split_k", ""))' 2>/dev/null)" ]; then
    timeout $((235 - (SECONDS - start))) python -m nanoinfer.bench.gemv --split-k > "$OUT/bench_gemv_split_k.log" 2>&1
    echo "bench.gemv --split-k: rc $? after $((SECONDS - start)) s"
    cat "$OUT/bench_gemv_split_k.log"
fi
