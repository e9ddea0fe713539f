"""The one-row GEMV (kernels/gemv.py) against cuBLAS, at decode shapes, in CUDA graphs.

    PYTHONPATH=. python3 -m nanoinfer.bench.gemv            # default configs
    PYTHONPATH=. python3 -m nanoinfer.bench.gemv --sweep    # also search tile/warp/stage configs

Each row times one projection of a layer as the engine runs it at batch 1: cuBLAS with the kernel
before it (RMSNorm with the residual add, or SiLU * mul) against the one fused GEMV. Times are per
call, from a CUDA graph of many calls over distinct weights (no L2 reuse, launch gaps included);
% is the weight's bytes over the time, against the measured copy bandwidth.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels import norm_act
from nanoinfer.kernels.gemv import default_config, gemv
from nanoinfer.utils.ceilings import measure_ceilings

DTYPE = torch.bfloat16
# (model, projection, N, K, prologue)
SHAPES = [
    ("0.6B", "qkv", 4096, 1024, "norm"), ("0.6B", "o", 1024, 2048, None),
    ("0.6B", "gate_up", 6144, 1024, "norm"), ("0.6B", "down", 1024, 3072, "silu"),
    ("0.6B", "lm_head", 151936, 1024, None),
    ("8B", "qkv", 6144, 4096, "norm"), ("8B", "o", 4096, 4096, None),
    ("8B", "gate_up", 24576, 4096, "norm"), ("8B", "down", 4096, 12288, "silu"),
    ("8B", "lm_head", 151936, 4096, None),
]


def make_calls(n, k, prologue, fused: bool, config=None, copies=None, rows=1, kernel=gemv):
    """Calls of one projection over distinct weights at `rows` rows: the fused `kernel` (the GEMV,
    or kernels/skinny_gemm.py) with its prologue, or cuBLAS after the kernel it fuses."""
    if copies is None:  # more bytes of weights than L2 holds, cycled through
        copies = min(24, max(2, -(-(256 << 20) // (2 * n * k))))
    ws = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, 2 * k if prologue == "silu" else k, device="cuda", dtype=DTYPE)
    res, nw = torch.randn(rows, k, device="cuda", dtype=DTYPE), torch.ones(k, device="cuda", dtype=DTYPE)
    out = torch.empty_like(res)
    if fused and prologue == "norm":
        return [lambda w=w: kernel(x, w, norm_weight=nw, eps=1e-6, residual=res, residual_out=out, config=config)
                for w in ws]
    if fused:
        return [lambda w=w: kernel(x, w, silu_mul=prologue == "silu", config=config) for w in ws]
    if prologue == "norm":
        return [lambda w=w: F.linear(norm_act.rms_norm(x, nw, 1e-6, res)[0], w) for w in ws]
    if prologue == "silu":
        return [lambda w=w: F.linear(norm_act.silu_and_mul(x), w) for w in ws]
    return [lambda w=w: F.linear(x, w) for w in ws]


def max_error(n, k, prologue, rows=1, kernel=gemv) -> float:
    """Largest |fused - cuBLAS path| over the output, relative to the output's largest value."""
    torch.manual_seed(0)
    fused = make_calls(n, k, prologue, True, copies=1, rows=rows, kernel=kernel)[0]()
    torch.manual_seed(0)
    ref = make_calls(n, k, prologue, False, copies=1, rows=rows, kernel=kernel)[0]()
    return ((fused.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def sweep_configs(n):
    for bn, bk, warps, stages in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8), (2, 4)):
        if bn * bk <= 16384 and n // bn >= 32:
            yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--only", nargs="+", help="model:projection pairs, e.g. 0.6B:o 8B:down")
    args = p.parse_args()
    copy_bw, _ = measure_ceilings("cuda")
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'model':5} {'proj':8} {'cuBLAS+pre us':>14} {'GEMV us':>8} {'% copy':>7} {'speed-up':>8} {'rel err':>8}")
    for model, name, n, k, prologue in SHAPES:
        if args.only and f"{model}:{name}" not in args.only:
            continue
        base = bench_graph(make_calls(n, k, prologue, False)) * 1e3
        fused = bench_graph(make_calls(n, k, prologue, True)) * 1e3
        pct = 100 * 2 * n * k / (fused * 1e-6) / copy_bw
        print(f"{model:5} {name:8} {base:14.1f} {fused:8.1f} {pct:7.1f} {base / fused:7.2f}x "
              f"{max_error(n, k, prologue):8.1e}", flush=True)
        if args.sweep:
            print_best_configs(sweep_configs(n), lambda cfg: make_calls(n, k, None, True, cfg), 2 * n * k, copy_bw,
                               f"best plain configs (default {default_config(n, k)})")


def print_best_configs(configs, make_calls_of, weight_bytes: int, copy_bw: float, title: str):
    """Time each config's calls (a CUDA graph of them; configs that do not fit are skipped) and print
    the three fastest, with the share of the copy bandwidth their weight reads reach."""
    best = []
    for cfg in configs:
        try:
            best.append((bench_graph(make_calls_of(cfg), replays=5) * 1e3, cfg))
        except OutOfResources:
            continue
    best.sort(key=lambda b: b[0])
    print(f"      {title}:")
    for t, cfg in best[:3]:
        print(f"        {t:7.1f} us {100 * weight_bytes / (t * 1e-6) / copy_bw:5.1f} %  {cfg}", flush=True)


if __name__ == "__main__":
    main()
