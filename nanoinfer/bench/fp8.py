"""FP8 weight GEMMs and GEMVs against bf16 (CUDA), at the 8B shape's projections.

    PYTHONPATH=. python3 -m nanoinfer.bench.fp8 [--tokens 1 16 256 4096 8192]

Each row is one projection at M tokens: bf16 cuBLAS (torch.mm); FP8 W8A8 with per-token activation
scales through torch._scaled_mm (row-wise weight scales, what per-channel checkpoints and online
fp8 run); FP8 W8A8 with 128x128 block weight scales and per-token-group activations through the
Triton GEMM (kernels/fp8_gemm.py, what Qwen3-FP8 runs); the ones also through the Triton GEMM with
row-wise scales (to compare it with _scaled_mm). Every FP8 time includes the activation
quantization kernel (kernels/fp8_quant.py). M = 1 rows compare the GEMVs (kernels/gemv.py,
kernels/fp8_gemv.py) instead, with % of the copy bandwidth for their weight bytes. Times are per
call, replayed from a CUDA graph over several weight copies (no L2 reuse)."""
import argparse

import torch

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels.fp8_gemm import fp8_gemm
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

    def scaled_mm(q, r):
        xq, xs = quantize_fp8(x)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=r.t(), out_dtype=torch.bfloat16)

    def triton_rows(q, r):
        xq, xs = quantize_fp8(x)
        return fp8_gemm(xq, xs, q, r, k, torch.bfloat16)

    def triton_blocks(q, b):
        xq, xs = quantize_fp8(x, 128)
        return fp8_gemm(xq, xs, q, b, 128, torch.bfloat16)

    return {"bf16 cuBLAS": [lambda w=w: torch.mm(x, w.t()) for w, _, _, _ in ws],
            "fp8 _scaled_mm (row-wise)": [lambda q=q, r=r: scaled_mm(q, r) for _, q, r, _ in ws],
            "fp8 Triton (row-wise)": [lambda q=q, r=r: triton_rows(q, r) for _, q, r, _ in ws],
            "fp8 Triton (128x128 blocks)": [lambda q=q, b=b: triton_blocks(q, b) for _, q, _, b in ws]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096, 8192])
    args = p.parse_args()
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
