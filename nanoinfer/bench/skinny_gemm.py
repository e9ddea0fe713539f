"""The few-row GEMM (kernels/skinny_gemm.py), and the GEMV at the rows it takes, against cuBLAS, at
small-batch decode shapes, in CUDA graphs.

    PYTHONPATH=. python3 -m nanoinfer.bench.skinny_gemm [--rows 2,4,8,16,32,64]
    PYTHONPATH=. python3 -m nanoinfer.bench.skinny_gemm --sweep 8    # also search configs at 8 rows

Each row times one projection of a layer as the engine runs it at M rows: cuBLAS with the kernel
before it (RMSNorm with the residual add, or SiLU * mul) against the one fused kernel (the GEMV's
column: up to kernels/gemv.MAX_ROWS rows). Times are per
call, from a CUDA graph of many calls over distinct weights (no L2 reuse, launch gaps included);
% is the weight's bytes over the time, against the measured copy bandwidth.
"""
import argparse
import itertools

from nanoinfer.bench.gemv import SHAPES, make_calls, max_error, print_best_configs
from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels import gemv as gemv_kernel
from nanoinfer.kernels.skinny_gemm import default_config, skinny_gemm
from nanoinfer.utils.ceilings import measure_ceilings


def sweep_configs(m, n, k):
    block_m = max(16, 1 << (m - 1).bit_length())
    for bn, bk, split, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (3, 4)):
        tiles = -(-n // bn) * split
        if 48 <= tiles <= 1024 and k // split >= bk:
            yield dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="2,4,8,16,32,64")
    p.add_argument("--sweep", type=int, nargs="*", metavar="ROWS", help="also search configs at these row counts")
    p.add_argument("--only", nargs="+", help="model:projection pairs, e.g. 0.6B:o 8B:down")
    args = p.parse_args()
    copy_bw, _ = measure_ceilings("cuda")
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'model':5} {'proj':8} {'rows':>4} {'cuBLAS+pre us':>14} {'% copy':>7} {'skinny us':>9} {'% copy':>7} "
          f"{'speed-up':>8} {'rel err':>8} {'GEMV us':>8}")
    for model, name, n, k, prologue in SHAPES:
        if args.only and f"{model}:{name}" not in args.only:
            continue
        for m in map(int, args.rows.split(",")):
            base = bench_graph(make_calls(n, k, prologue, False, rows=m, kernel=skinny_gemm)) * 1e3
            fused = bench_graph(make_calls(n, k, prologue, True, rows=m, kernel=skinny_gemm)) * 1e3
            pct = lambda t: 100 * 2 * n * k / (t * 1e-6) / copy_bw  # noqa: E731
            gemv_us = "" if m > gemv_kernel.MAX_ROWS else \
                f"{bench_graph(make_calls(n, k, prologue, True, rows=m, kernel=gemv_kernel.gemv)) * 1e3:8.1f}"
            print(f"{model:5} {name:8} {m:4} {base:14.1f} {pct(base):7.1f} {fused:9.1f} {pct(fused):7.1f} "
                  f"{base / fused:7.2f}x {max_error(n, k, prologue, m, skinny_gemm):8.1e} {gemv_us}", flush=True)
        for m in args.sweep or ():
            calls_of = lambda cfg, m=m: make_calls(n, k, prologue, True, cfg, rows=m, kernel=skinny_gemm)  # noqa: E731
            print_best_configs(sweep_configs(m, n, k), calls_of, 2 * n * k, copy_bw,
                               f"best configs at {m} rows (default {default_config(m, n, k)})")


if __name__ == "__main__":
    main()
