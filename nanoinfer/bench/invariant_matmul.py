"""The batch-invariant GEMM (kernels/invariant_matmul.py) against cuBLAS at Qwen3-0.6B and 8B shapes.

    PYTHONPATH=. python3 -m nanoinfer.bench.invariant_matmul [--rows 1,64,256,2048]
    PYTHONPATH=. python3 -m nanoinfer.bench.invariant_matmul --tune [--write]

Each line: one projection at M rows, microseconds per call from a CUDA graph (bench_graph: distinct
weights cycled, no L2 reuse), cuBLAS next to the kernel's chosen tiles. --tune times a grid of tiles
for each shape at 64, 256 and 4096 rows (one per row bucket of kernels/invariant_matmul.py), checks
that each gives the same bits (what lets the tiles follow the number of rows), and prints the best
as the kernel's TUNED table; --write puts that table into kernels/invariant_matmul.py.
"""
import argparse
import itertools
import pathlib
import re

import torch
import torch.nn.functional as F

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels import invariant_matmul as kernel
from nanoinfer.kernels.invariant_matmul import invariant_matmul, rows_bucket

SHAPES = {"0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
          "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)}}
TUNE_ROWS = (64, 256, 4096)


def grid(rows: int):
    """Candidate tiles (block_m, block_n, block_k, warps, stages) for `rows` rows."""
    if rows <= kernel.FEW_ROWS_MAX:
        space = itertools.product((64,), (16, 32, 64), (64, 128, 256), (3, 4))
    else:
        space = itertools.product((64, 128), (32, 64, 128, 256), (64, 128), (3, 4))
    for bm, bn, bk, stages in space:
        if stages * (bm + bn) * bk * 2 <= 200_000 and not (bm == 128 and bn == 32):
            yield bm, bn, bk, 8 if bm * bn >= 128 * 128 else 4, stages


def weights_for(n, k):
    copies = 2 if n * k > 100_000_000 else 4
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def timed(x, weights, config=None):
    return bench_graph([lambda w=w: invariant_matmul(x, w, config=config) for w in weights]) * 1000


def cases(rows_list, models=tuple(SHAPES)):
    """(label, n, k, rows, input, weights) for each shape at each row count (no output over 600M values)."""
    for model, projections in SHAPES.items():
        if model not in models:
            continue
        for name, (n, k) in projections.items():
            weights = weights_for(n, k)
            for rows in rows_list:
                if rows * n <= 600_000_000:
                    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                    yield f"{model:5} {name:8} M={rows:<5}", n, k, rows, x, weights


def cublas_us(x, weights):
    return bench_graph([lambda w=w: F.linear(x, w) for w in weights]) * 1000


def tune(rows_list=TUNE_ROWS, models=tuple(SHAPES)) -> dict:
    table = {}
    for label, n, k, rows, x, weights in cases(rows_list, models):
        ref = invariant_matmul(x, weights[0])
        results = []
        for tiles in grid(rows):
            config = kernel._as_config(tiles)
            if not torch.equal(invariant_matmul(x, weights[0], config=config), ref):
                raise SystemExit(f"{label} tiles {tiles}: different bits")
            results.append((timed(x, weights, config), tiles))
        best_t, best = min(results)
        cublas = cublas_us(x, weights)
        print(f"{label} cuBLAS {cublas:7.1f} us  rules {timed(x, weights):7.1f}  best {best_t:7.1f} {best} "
              f"({best_t / cublas:.2f}x cuBLAS)", flush=True)
        table[(rows_bucket(rows), n, k)] = best
    return table


def write(table: dict):
    path = pathlib.Path(kernel.__file__)
    text = path.read_text()
    body = "".join(f"    {key}: {tiles},\n" for key, tiles in sorted(table.items()))
    text = re.sub(r"TUNED: dict = \{[^}]*\}", "TUNED: dict = {\n" + body + "}", text, count=1)
    path.write_text(text)
    print(f"wrote {len(table)} entries into {path}")


def compare(rows_list, models):
    for label, _, _, _, x, weights in cases(rows_list, models):
        cublas, ours = cublas_us(x, weights), timed(x, weights)
        print(f"{label} cuBLAS {cublas:8.1f} us  invariant {ours:8.1f} us ({ours / cublas:.2f}x)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", help="row counts, e.g. 1,64,256,2048 (the default; --tune: 64,256,4096)")
    p.add_argument("--tune", action="store_true", help="time a grid of tiles per shape and row bucket")
    p.add_argument("--write", action="store_true", help="with --tune: write the TUNED table into the kernel")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    if args.tune:
        table = tune([int(r) for r in (args.rows or ",".join(map(str, TUNE_ROWS))).split(",")], args.models)
        print("TUNED =", table)
        if args.write:
            write(table)
        return
    compare([int(r) for r in (args.rows or "1,64,256,2048").split(",")], args.models)


if __name__ == "__main__":
    main()
