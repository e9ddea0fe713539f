"""The few-row GEMM (kernels/skinny_gemm.py) against cuBLAS, at small-batch decode shapes, in CUDA
graphs.

    PYTHONPATH=. python3 -m nanoinfer.bench.skinny_gemm [--rows 2,4,8,16,32,64]
    PYTHONPATH=. python3 -m nanoinfer.bench.skinny_gemm --sweep 8    # also search configs at 8 rows

Each row times one projection of a layer as the engine runs it at M rows: cuBLAS with the kernel
before it (RMSNorm with the residual add, or SiLU * mul) against the one fused kernel. Times are per
call, from a CUDA graph of many calls over distinct weights (no L2 reuse, launch gaps included);
% is the weight's bytes over the time, against the measured copy bandwidth.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F

from nanoinfer.bench.gemv import SHAPES, print_best_configs
from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels import norm_act
from nanoinfer.kernels.skinny_gemm import default_config, skinny_gemm
from nanoinfer.utils.ceilings import measure_ceilings

DTYPE = torch.bfloat16


def make_calls(m, n, k, prologue, fused: bool, config=None, copies=None):
    if copies is None:  # more bytes of weights than L2 holds, cycled through
        copies = min(24, max(2, -(-(256 << 20) // (2 * n * k))))
    ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(m, 2 * k if prologue == "silu" else k, device="cuda", dtype=DTYPE)
    res, nw = torch.randn(m, k, device="cuda", dtype=DTYPE), torch.ones(k, device="cuda", dtype=DTYPE)
    out = torch.empty_like(res)
    if fused and prologue == "norm":
        return [lambda w=w: skinny_gemm(x, w, norm_weight=nw, eps=1e-6, residual=res, residual_out=out,
                                        config=config) for w in ws]
    if fused:
        return [lambda w=w: skinny_gemm(x, w, silu_mul=prologue == "silu", config=config) for w in ws]
    if prologue == "norm":
        return [lambda w=w: F.linear(norm_act.rms_norm(x, nw, 1e-6, res)[0], w) for w in ws]
    if prologue == "silu":
        return [lambda w=w: F.linear(norm_act.silu_and_mul(x), w) for w in ws]
    return [lambda w=w: F.linear(x, w) for w in ws]


def max_error(m, n, k, prologue) -> float:
    """Largest |fused - cuBLAS path| over the output, relative to the output's largest value."""
    torch.manual_seed(0)
    fused = make_calls(m, n, k, prologue, True, copies=1)[0]()
    torch.manual_seed(0)
    ref = make_calls(m, n, k, prologue, False, copies=1)[0]()
    return ((fused.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def sweep_configs(m, n, k):
    block_m = max(16, 1 << (m - 1).bit_length())
    for bn, bk, split in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
        tiles = -(-n // bn) * split
        if 96 <= tiles <= 1024 and k // split >= bk:
            yield dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=4)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="2,4,8,16,32,64")
    p.add_argument("--sweep", type=int, nargs="*", metavar="ROWS", help="also search configs at these row counts")
    p.add_argument("--only", nargs="+", help="model:projection pairs, e.g. 0.6B:o 8B:down")
    args = p.parse_args()
    copy_bw, _ = measure_ceilings("cuda")
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'model':5} {'proj':8} {'rows':>4} {'cuBLAS+pre us':>14} {'% copy':>7} {'skinny us':>9} {'% copy':>7} "
          f"{'speed-up':>8} {'rel err':>8}")
    for model, name, n, k, prologue in SHAPES:
        if args.only and f"{model}:{name}" not in args.only:
            continue
        for m in map(int, args.rows.split(",")):
            base = bench_graph(make_calls(m, n, k, prologue, False)) * 1e3
            fused = bench_graph(make_calls(m, n, k, prologue, True)) * 1e3
            pct = lambda t: 100 * 2 * n * k / (t * 1e-6) / copy_bw  # noqa: E731
            print(f"{model:5} {name:8} {m:4} {base:14.1f} {pct(base):7.1f} {fused:9.1f} {pct(fused):7.1f} "
                  f"{base / fused:7.2f}x {max_error(m, n, k, prologue):8.1e}", flush=True)
        for m in args.sweep or ():
            print_best_configs(sweep_configs(m, n, k), lambda cfg: make_calls(m, n, k, prologue, True, cfg),
                               2 * n * k, copy_bw, f"best configs at {m} rows (default {default_config(m, n, k)})")


if __name__ == "__main__":
    main()
