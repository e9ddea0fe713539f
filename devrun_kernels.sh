#!/usr/bin/env bash
# Issue 51, kernel helper's GPU checks, for the lead to run on the device from the repo root:
#     bash devrun_kernels.sh            tests, then benchmarks (under 240 s in all; logs under $OUT)
#     bash devrun_kernels.sh bench      the benchmarks alone (a second call on a warm machine: Triton's
#                                       cache then holds the kernels, so the sweep gets further)
# 1. the CUDA tests of the W8A16 GEMM, the FP8 layer's paths and the split-K GEMV;
# 2. the W8A16 micro-benchmark (python -m nanoinfer.bench.fp8 --w8a16): the old few-row FP8 path against
#    W8A16 at the chosen and at every candidate config, M 1-128, Qwen3-8B projections, per channel;
# 3. the one-row GEMV's split-K against the unsplit GEMV at the 30B-A3B shapes (bench.gemv --split-k).
# Each step has its own time limit and prints as it goes: a step cut short still leaves its log.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/devrun_kernels}
mkdir -p "$OUT"
start=$SECONDS
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "$what" != bench ]; then
    timeout 90 python -m pytest -q -p no:randomly -m cuda tests/test_fp8_skinny_gemm.py \
        tests/test_quant_fp8.py::test_cuda_fp8_linear_matches_dequantized_reference \
        tests/test_fp8_prologue_quant.py::test_cuda_fp8_layer_takes_a_deferred_input \
        tests/test_gemv.py::test_one_row_split_over_k > "$OUT/tests.log" 2>&1
    echo "tests: rc $? after $((SECONDS - start)) s"
    tail -15 "$OUT/tests.log"
fi

timeout $((205 - (SECONDS - start))) python -m nanoinfer.bench.fp8 --w8a16 > "$OUT/bench_fp8_w8a16.log" 2>&1
echo "bench.fp8 --w8a16: rc $? after $((SECONDS - start)) s"
sed -n '1,/^== 2/p' "$OUT/bench_fp8_w8a16.log"   # part 1: old path, chosen config, conversions, prologues
sed -n '/^== 3/,$p' "$OUT/bench_fp8_w8a16.log"   # the summary, if the sweep finished

timeout $((235 - (SECONDS - start))) python -m nanoinfer.bench.gemv --split-k > "$OUT/bench_gemv_split_k.log" 2>&1
echo "bench.gemv --split-k: rc $? after $((SECONDS - start)) s"
cat "$OUT/bench_gemv_split_k.log"
