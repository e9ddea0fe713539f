"""The batch-invariant GEMM (kernels/invariant_matmul.py) against cuBLAS at Qwen3-0.6B and 8B shapes.

    PYTHONPATH=. python3 -m nanoinfer.bench.invariant_matmul [--rows 1,64,256,2048] [--models 8B]
    PYTHONPATH=. python3 -m nanoinfer.bench.invariant_matmul --sweep [--rows 256,512] [--write]

Each line: one projection at M rows, microseconds per call from a CUDA graph (bench_graph: distinct
weights cycled, no L2 reuse), cuBLAS next to the tiles invariant_config picks. --sweep also times a
grid of tiles, checks that each gives the same bits (what lets the tiles follow the number of
rows), and prints the best four; --write puts the best at each row bucket's size (ROW_BUCKETS) into
the kernel's TUNED table.
"""
import argparse
import contextlib
import itertools
import json
import pathlib
import re

import torch
import torch.nn.functional as F

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels import invariant_matmul as kernel
from nanoinfer.kernels.invariant_matmul import invariant_matmul

SHAPES = {"0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
          "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "lm_head": (151936, 4096)}}


def grid(rows: int):
    """Candidate tiles (block_m, block_n, block_k, warps, stages) for `rows` rows: for a few rows
    narrow weight tiles, else the shapes that suit Hopper's warp-group MMA (64 or 128 rows a tile)."""
    if rows <= kernel.FEW_ROWS_MAX:
        for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256), (3, 4)):
            if stages * (64 + bn) * bk * 2 <= 220_000:
                yield 64, bn, bk, 4, stages
        return
    yield from ((64, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 4, 4),
                (64, 128, 64, 4, 5), (64, 128, 128, 4, 3), (64, 256, 64, 4, 3), (64, 256, 64, 8, 3),
                (128, 64, 64, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 4, 3), (128, 128, 64, 4, 4),
                (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
                (64, 32, 128, 4, 4), (64, 64, 64, 4, 4))


def weights_for(n, k):
    copies = 2 if n * k > 100_000_000 else 4
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def timed(x, weights, config=None, replays=15):
    return bench_graph([lambda w=w: invariant_matmul(x, w, config=config) for w in weights], replays=replays) * 1000


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


def compare(rows_list, models, sweep: bool, log=None) -> dict:
    """Prints each case; with `sweep` returns the best tiles of each case at a row bucket's size,
    as the kernel's TUNED table: (rows bucket, n, k) -> tiles."""
    tuned = {}
    for label, n, k, rows, x, weights in cases(rows_list, models):
        cublas, ours = cublas_us(x, weights), timed(x, weights)
        line = f"{label} cuBLAS {cublas:8.1f} us  invariant {ours:8.1f} us ({ours / cublas:.2f}x)"
        if sweep and rows * n <= 80_000_000:  # the LM head only sees sampled rows
            ref = invariant_matmul(x, weights[0])
            results = []
            for tiles in grid(rows):
                config = kernel._as_config(tiles)
                if not torch.equal(invariant_matmul(x, weights[0], config=config), ref):
                    raise SystemExit(f"{label} tiles {tiles}: different bits")
                results.append((timed(x, weights, config, replays=7), tiles))
            results.sort()
            if rows in kernel.ROW_BUCKETS:
                tuned[(rows, n, k)] = results[0][1]
            line += "  best " + " ".join(f"{t:.1f}{tiles}" for t, tiles in results[:4])
            if log is not None:
                log.write(json.dumps({"case": label, "n": n, "k": k, "rows": rows,
                                      "cublas": cublas, "rule": ours, "results": results}) + "\n")
                log.flush()
        print(line, flush=True)
    return tuned


def write_tuned(table: dict):
    """Puts `table` into kernels/invariant_matmul.py as its TUNED table."""
    path = pathlib.Path(kernel.__file__)
    body = "".join(f"    {key}: {tiles},\n" for key, tiles in sorted(table.items()))
    text = re.sub(r"TUNED: dict = \{[^}]*\}", "TUNED: dict = {\n" + body + "}", path.read_text(), count=1)
    path.write_text(text)
    print(f"wrote {len(table)} tuned tiles into {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,64,256,2048")
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time a grid of tiles (each checked for the same bits)")
    p.add_argument("--log", help="with --sweep: write every case's timings here, a JSON object a line")
    p.add_argument("--write", action="store_true", help="with --sweep: write the best tiles at each row bucket's "
                                                        "size into the kernel's TUNED table")
    args = p.parse_args()
    with open(args.log, "w") if args.log else contextlib.nullcontext() as log:
        tuned = compare([int(r) for r in args.rows.split(",")], args.models, args.sweep, log)
    if args.write:
        write_tuned({**kernel.TUNED, **tuned})
    print("tiles: (block_m, block_n, block_k, warps, stages)")


if __name__ == "__main__":
    main()
