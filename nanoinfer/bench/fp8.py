"""FP8 weight GEMMs and GEMVs against bf16 (CUDA), at the 8B shape's projections.

    PYTHONPATH=. python3 -m nanoinfer.bench.fp8 [--tokens 1 16 256 4096 8192]
    PYTHONPATH=. python3 -m nanoinfer.bench.fp8 --w8a16 [--tokens 1 8 16 32 64 128] [--llama] [--block]

--w8a16 (bench/fp8_w8a16.py) compares, per row count and projection, the old few-row path (the
GEMV at one row, else activation quantization + the W8A8 GEMM the layer ran) with the W8A16 GEMM
(kernels/fp8_skinny_gemm.py) at its chosen config and at every candidate config, in % of the copy
bandwidth, and prints the measured best as the kernel's TUNED table.

Each row is one projection at M tokens: bf16 cuBLAS (torch.mm); FP8 W8A8 with per-token activation
scales through torch._scaled_mm (row-wise weight scales, what per-channel checkpoints and online
fp8 run), also with fast accumulation (use_fast_accum: the tensor cores' FP8 accumulator without
periodic promotion to float32, which vLLM's CUTLASS FP8 kernels use, and the engine runs); FP8
W8A8 with 128x128 block weight scales and per-token-group activations through the Triton GEMM
(kernels/fp8_gemm.py, what Qwen3-FP8 runs); the ones also through the Triton GEMM with row-wise
scales (to compare it with _scaled_mm). Every FP8 time includes the activation
quantization kernel (kernels/fp8_quant.py). M = 1 rows compare the GEMVs (kernels/gemv.py,
kernels/fp8_gemv.py) instead, with % of the copy bandwidth for their weight bytes. Times are per
call, replayed from a CUDA graph over several weight copies (no L2 reuse)."""
import argparse

import torch

from nanoinfer.bench import fp8_w8a16
from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels.fp8_gemm import default_config, fp8_gemm
from nanoinfer.kernels.fp8_gemv import fp8_gemv
from nanoinfer.kernels.fp8_quant import quantize_fp8
from nanoinfer.kernels.gemv import gemv
from nanoinfer.utils.ceilings import measure_ceilings

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]


def weights(n, k, copies):
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        row = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
        q = (w.float() / row).clamp(-448, 448).to(torch.float8_e4m3fn)
        block = (torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-3).repeat_interleave(128, 0)[:n]
        out.append((w, q, row, block.contiguous()))
    return out


def calls(m, n, k):
    copies = min(8, max(2, -(-(256 << 20) // (n * k))))
    ws = weights(n, k, copies)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if m == 1:
        return {"bf16 GEMV": [lambda w=w: gemv(x, w) for w, _, _, _ in ws],
                "fp8 GEMV (per channel)": [lambda q=q, r=r: fp8_gemv(x, q, r, k) for _, q, r, _ in ws],
                "fp8 GEMV (128x128 blocks)": [lambda q=q, b=b: fp8_gemv(x, q, b, 128) for _, q, _, b in ws]}

    def scaled_mm(q, r, fast=False):
        xq, xs = quantize_fp8(x)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=r.t(), out_dtype=torch.bfloat16, use_fast_accum=fast)

    def triton_rows(q, r):
        xq, xs = quantize_fp8(x)
        return fp8_gemm(xq, xs, q, r, k, torch.bfloat16)

    def triton_blocks(q, b):
        xq, xs = quantize_fp8(x, 128)
        return fp8_gemm(xq, xs, q, b, 128, torch.bfloat16)

    return {"bf16 cuBLAS": [lambda w=w: torch.mm(x, w.t()) for w, _, _, _ in ws],
            "fp8 _scaled_mm (row-wise)": [lambda q=q, r=r: scaled_mm(q, r) for _, q, r, _ in ws],
            "fp8 _scaled_mm (fast accum)": [lambda q=q, r=r: scaled_mm(q, r, True) for _, q, r, _ in ws],
            "fp8 Triton (row-wise)": [lambda q=q, r=r: triton_rows(q, r) for _, q, r, _ in ws],
            "fp8 Triton (128x128 blocks)": [lambda q=q, b=b: triton_blocks(q, b) for _, q, _, b in ws]}


TUNE_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                for bm in (16, 32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (3, 4)
                if not (bm == 128 and bn == 128 and st == 4)]


def tune(tokens):
    """The Triton GEMM (row-wise and 128x128-block scales) at every config of TUNE_CONFIGS: the
    default's time and the best three per shape."""
    for m in tokens:
        for name, n, k in SHAPES:
            ws = weights(n, k, min(8, max(2, -(-(256 << 20) // (n * k)))))
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for label, gk, pick in (("row-wise", k, 2), ("128x128 blocks", 128, 3)):
                xq, xs = quantize_fp8(x, None if gk == k else 128)
                timed = []
                for cfg in TUNE_CONFIGS:
                    try:
                        fns = [lambda q=w[1], s=w[pick], c=cfg: fp8_gemm(xq, xs, q, s, gk, torch.bfloat16, c) for w in ws]
                        timed.append((bench_graph(fns, calls=8 if m >= 4096 else 24, replays=5), cfg))
                    except Exception as e:  # (a config out of shared memory)
                        print(f"  skipped {cfg}: {type(e).__name__}")
                timed.sort(key=lambda t: t[0])
                default = dict(default_config(m, n, 1 if gk == k else -(-k // 128)))
                d = next((ms for ms, c in timed if c == default), None)
                best = ", ".join(f"{ms * 1e3:.1f} us {c}" for ms, c in timed[:3])
                print(f"M={m:<5} {name:8} {label:15} default {d * 1e3 if d else float('nan'):.1f} us; best: {best}",
                      flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", help="row counts (default 1 16 256 4096 8192; --w8a16: "
                   + " ".join(map(str, fp8_w8a16.TOKENS)) + ")")
    p.add_argument("--tune", action="store_true", help="time the Triton GEMM's tile configs instead, the best per row")
    p.add_argument("--w8a16", action="store_true", help="the few-row W8A16 GEMM against the old few-row path")
    p.add_argument("--llama", action="store_true", help="--w8a16: Llama-3-8B's MLP (28672 / 14336) for Qwen3-8B's")
    p.add_argument("--block", action="store_true", help="--w8a16: 128x128 block scales instead of per channel")
    p.add_argument("--no-sweep", action="store_true", help="--w8a16: the chosen configs only, no candidates")
    args = p.parse_args()
    if args.w8a16:
        return fp8_w8a16.run(args.tokens or fp8_w8a16.TOKENS, args.llama, args.block, not args.no_sweep)
    args.tokens = args.tokens or [1, 16, 256, 4096, 8192]
    if args.tune:
        return tune(args.tokens)
    copy_bw, bf16_rate = measure_ceilings("cuda")
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, bf16 matmul {bf16_rate / 1e12:.0f} TFLOP/s")
    for m in args.tokens:
        for name, n, k in SHAPES:
            results = {label: bench_graph(fns, calls=8 if m >= 4096 else 24, replays=9)
                       for label, fns in calls(m, n, k).items()}
            base = next(iter(results.values()))
            for label, ms in results.items():
                if m == 1:
                    nbytes = n * k * (2 if label.startswith("bf16") else 1)
                    rate = f"{nbytes / (ms * 1e-3) / copy_bw * 100:6.1f} % copy"
                else:
                    rate = f"{2 * m * n * k / (ms * 1e-3) / 1e12:7.1f} TFLOP/s"
                print(f"M={m:<5} {name:8} {label:28} {ms * 1e3:9.1f} us {rate}  {base / ms:5.2f}x bf16", flush=True)


if __name__ == "__main__":
    main()
