"""The 2-4 row GEMV (kernels/gemv.py, gemv_rows) against what `linear` ran before it at those rows
(cuBLAS, or the few-row GEMM where it routes), at decode shapes, in CUDA graphs.

    PYTHONPATH=. python3 -m nanoinfer.bench.gemv_rows [--rows 2,3,4] [--sweep ROWS ..]

Times are per call, from a CUDA graph of many calls over distinct weights (no L2 reuse, launch gaps
included); % is the weight's bytes over the time, against the measured copy bandwidth.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from nanoinfer.bench.gemv import DTYPE, SHAPES
from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels.gemv import gemv_rows, rows_config
from nanoinfer.kernels.skinny_gemm import skinny_gemm
from nanoinfer.layers.linear_method import takes_skinny_gemm
from nanoinfer.utils.ceilings import measure_ceilings


def calls(n, k, rows, product, copies=None):
    if copies is None:  # more bytes of weights than L2 holds, cycled through
        copies = min(24, max(2, -(-(256 << 20) // (2 * n * k))))
    ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
    return [lambda w=w: product(x, w) for w in ws]


def before(x, w):
    """What linear() ran at these rows before gemv_rows."""
    return skinny_gemm(x, w) if takes_skinny_gemm(x, w) else F.linear(x, w)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="2,3,4")
    p.add_argument("--sweep", type=int, nargs="*", metavar="ROWS", help="also search configs at these row counts")
    args = p.parse_args()
    copy_bw, _ = measure_ceilings("cuda")
    pct = lambda t, n, k: 100 * 2 * n * k / (t * 1e-6) / copy_bw  # noqa: E731
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'model':5} {'proj':8} {'rows':>4} {'before us':>9} {'% copy':>7} {'GEMV us':>8} {'% copy':>7} "
          f"{'speed-up':>8} {'rel err':>8}")
    for model, name, n, k, _ in SHAPES:
        for m in map(int, args.rows.split(",")):
            base = bench_graph(calls(n, k, m, before)) * 1e3
            new = bench_graph(calls(n, k, m, gemv_rows)) * 1e3
            x, w = torch.randn(m, k, device="cuda", dtype=DTYPE), torch.randn(n, k, device="cuda", dtype=DTYPE)
            ref = F.linear(x.float(), w.float())
            err = ((gemv_rows(x, w).float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{model:5} {name:8} {m:4} {base:9.1f} {pct(base, n, k):7.1f} {new:8.1f} {pct(new, n, k):7.1f} "
                  f"{base / new:7.2f}x {err:8.1e}", flush=True)
        for m in args.sweep or ():
            best = []
            for bn, bk, warps, stages in itertools.product((4, 8), (256, 512, 1024), (4, 8), (2, 3)):
                if -(-n // bn) < 64:
                    continue
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                try:
                    best.append((bench_graph(calls(n, k, m, lambda x, w, c=cfg: gemv_rows(x, w, config=c)),
                                             replays=5) * 1e3, cfg))
                except OutOfResources:
                    continue
            best.sort(key=lambda b: b[0])
            print(f"      best at {m} rows (default {rows_config(n, k, m)}):")
            for t, cfg in best[:3]:
                print(f"        {t:7.1f} us {pct(t, n, k):5.1f} %  {cfg}", flush=True)


if __name__ == "__main__":
    main()
