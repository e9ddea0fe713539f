"""The batch-invariant GEMM (kernels/invariant_matmul.py) against cuBLAS at Qwen3-0.6B and 8B shapes.

    PYTHONPATH=. python3 -m nanoinfer.bench.invariant_matmul [--rows 1,64,256,4096] [--sweep]

Each line: one projection at M rows, microseconds per call from a CUDA graph (bench_graph: distinct
weights cycled, no L2 reuse), cuBLAS next to invariant_config's tiles, and with --sweep the best
three of a small grid of tiles, each checked for the default config's bits (the property that lets
the tiles follow the number of rows).
"""
import argparse
import itertools

import torch
import torch.nn.functional as F

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels.invariant_matmul import invariant_matmul

SHAPES = {"0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
          "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)}}


def grid():
    for bm, bn, bk, stages in itertools.product((64, 128), (16, 32, 64, 128, 256), (64, 128), (3, 4)):
        if bm * bn <= 128 * 256 and not (bm == 128 and bn < 128):
            yield {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": 8 if bm * bn >= 128 * 128 else 4,
                   "num_stages": stages, "group_m": 8}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,64,256,4096")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    p.add_argument("--only", nargs="+", help="model:projection pairs, e.g. 0.6B:o 8B:down")
    args = p.parse_args()
    dtype = torch.bfloat16
    for model, projections in SHAPES.items():
        for name, (n, k) in projections.items():
            if args.only and f"{model}:{name}" not in args.only:
                continue
            copies = 2 if n * k > 200_000_000 else 4
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
            for m in (int(r) for r in args.rows.split(",")):
                if m * n > 600_000_000:
                    continue
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                cublas = bench_graph([lambda w=w: F.linear(x, w) for w in weights]) * 1000
                ours = bench_graph([lambda w=w: invariant_matmul(x, w) for w in weights]) * 1000
                line = (f"{model:5} {name:8} M={m:<5} cuBLAS {cublas:8.1f} us  invariant {ours:8.1f} us "
                        f"({ours / cublas:.2f}x)")
                if args.sweep:
                    ref = invariant_matmul(x, weights[0])
                    timed = []
                    for cfg in grid():
                        same = torch.equal(invariant_matmul(x, weights[0], config=cfg), ref)
                        t = bench_graph([lambda w=w, c=cfg: invariant_matmul(x, w, config=c) for w in weights]) * 1000
                        timed.append((t, same, tuple(cfg.values())[:5]))
                    timed.sort()
                    line += "  best " + " ".join(f"{t:.1f}{c}{'' if s else ' DIFFERENT BITS'}" for t, s, c in timed[:3])
                    if not all(s for _, s, _ in timed):
                        line += "  (some configs differ bitwise!)"
                print(line, flush=True)
    print("tiles: (block_m, block_n, block_k, warps, stages)")


if __name__ == "__main__":
    main()
