"""The few-row FP8 paths at the 8B projections (CUDA), for `python -m nanoinfer.bench.fp8 --w8a16`: the
old one (the FP8 GEMV at one row; else the activation quantization kernel and the W8A8 GEMM the layer
ran: the Triton GEMM up to SCALED_MM_MIN_ROWS rows, torch._scaled_mm past them with row-wise scales)
against W8A16 (kernels/fp8_skinny_gemm.py). Times per call, replayed from a CUDA graph over several
weight copies (no L2 reuse). Printed as measured, in three parts:

1. per row count and projection: the old path; W8A16 at the config the layer picks now (config_for),
   also with Triton's FP8 -> bfloat16 conversion instead of the bit-moving one (BF16_BY_BITS);
   where a norm or SiLU * mul comes before the projection, that kernel then W8A16 against W8A16 with
   it fused (the prologue that W8A16_PROLOGUE_MAX_ROWS turns on);
2. the sweep: W8A16 at every candidate config (candidate_configs), each with its relative error;
3. the summary: old / chosen / best per row count and projection, the row counts at which the best
   W8A16 beats the old path, and the best configs as a TUNED literal for kernels/fp8_skinny_gemm.py
   (per row bucket: the config with the least total time over the bucket's row counts >= 2).

% copy: the bytes a call must move (FP8 weight, float32 scales, activations in and out) over its time,
against the measured device-to-device copy rate."""
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from nanoinfer.bench.kernels import bench_graph
from nanoinfer.kernels import norm_act
from nanoinfer.kernels.fp8_gemm import fp8_gemm
from nanoinfer.kernels.fp8_gemv import fp8_gemv
from nanoinfer.kernels.fp8_quant import quantize_fp8
from nanoinfer.kernels import fp8_skinny_gemm as w8a16_kernel
from nanoinfer.kernels.fp8_skinny_gemm import block_rows, candidate_configs, config_for, fp8_skinny_gemm
from nanoinfer.quant.fp8_linear import SCALED_MM_MIN_ROWS, scaled_mm_ok
from nanoinfer.quant.fp8_math import dequantize
from nanoinfer.utils.ceilings import measure_ceilings

TOKENS = [1, 8, 16, 32, 64, 128]
QWEN3_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
LLAMA3_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
BEFORE = {"qkv": "norm", "gate_up": "norm", "down": "silu"}  # the kernel before each projection
DTYPE = torch.bfloat16


def fp8_weights(n: int, k: int, gk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(FP8 weight, float32 scales) copies, more bytes in all than L2 holds."""
    out = []
    for _ in range(min(8, max(2, -(-(256 << 20) // (n * k))))):
        q = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        out.append((q, torch.rand(n, -(-k // gk), device="cuda") * 1e-3 + 1e-4))
    return out


def moved_bytes(m: int, n: int, k: int, kb: int) -> int:
    return n * k + n * kb * 4 + m * k * 2 + m * n * 2


def old_path(x: torch.Tensor, ws, gk: int):
    """(label, calls) of the path the layer ran before W8A16."""
    m = x.shape[0]
    if m == 1:
        return "old: fp8 GEMV", [lambda q=q, s=s: fp8_gemv(x, q, s, gk) for q, s in ws]
    per_channel = ws[0][1].shape[1] == 1
    scaled_mm = per_channel and m > SCALED_MM_MIN_ROWS and scaled_mm_ok(x.device, *ws[0][0].shape)

    def w8a8(q, s):
        xq, xs = quantize_fp8(x, None if per_channel else gk)
        if scaled_mm:
            return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.t(), out_dtype=DTYPE, use_fast_accum=True)
        return fp8_gemm(xq, xs, q, s, gk, DTYPE)
    return f"old: quant + {'_scaled_mm' if scaled_mm else 'Triton W8A8'}", [lambda q=q, s=s: w8a8(q, s) for q, s in ws]


def prologue_calls(m: int, k: int, before: str, ws, gk: int, cfg: dict, fused: bool, compile_only: bool = False):
    """W8A16 after the kernel before it (RMSNorm with the residual add, or SiLU * mul), or with it fused
    (compile_only: the fused kernel compiled, not run)."""
    g = torch.Generator(device="cuda").manual_seed(m)
    if before == "silu":
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=DTYPE, generator=g)
        if fused:
            return [lambda q=q, s=s: fp8_skinny_gemm(gate_up, q, s, gk, silu_mul=True, config=cfg,
                                                     compile_only=compile_only) for q, s in ws]
        return [lambda q=q, s=s: fp8_skinny_gemm(norm_act.silu_and_mul(gate_up), q, s, gk, config=cfg) for q, s in ws]
    x, res = (torch.randn(m, k, device="cuda", dtype=DTYPE, generator=g) for _ in range(2))
    nw, res_out = torch.ones(k, device="cuda", dtype=DTYPE), torch.empty_like(res)
    if fused:
        return [lambda q=q, s=s: fp8_skinny_gemm(x, q, s, gk, norm_weight=nw, eps=1e-6, residual=res,
                                                 residual_out=res_out, config=cfg, compile_only=compile_only)
                for q, s in ws]
    return [lambda q=q, s=s: fp8_skinny_gemm(norm_act.rms_norm(x, nw, 1e-6, res)[0], q, s, gk, config=cfg)
            for q, s in ws]


def by_bits(on: bool, fn, *args, **kwargs):
    """fn(*args, **kwargs) with kernels/fp8_skinny_gemm.py's BF16_BY_BITS set to `on`."""
    before, w8a16_kernel.BF16_BY_BITS = w8a16_kernel.BF16_BY_BITS, on
    try:
        return fn(*args, **kwargs)
    finally:
        w8a16_kernel.BF16_BY_BITS = before


def short(cfg: dict) -> str:
    return (f"BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} BK{cfg['BLOCK_K']} SK{cfg['SPLIT_K']} w{cfg['num_warps']} "
            f"st{cfg['num_stages']}")


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


class Row:
    """One (rows, projection) case: its input, weights and reference."""

    def __init__(self, m, name, n, k, gk, ws, copy_bw):
        self.m, self.name, self.n, self.k, self.gk, self.ws = m, name, n, k, gk, ws
        self.x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        self.ref = self.x.float() @ dequantize(*ws[0], gk, torch.float32).t()
        self.nbytes, self.copy_bw = moved_bytes(m, n, k, ws[0][1].shape[1]), copy_bw

    def time(self, fns, replays=9) -> float:
        return bench_graph(fns, calls=24, replays=replays) * 1e3  # us

    def pct(self, us: float) -> float:
        return 100 * self.nbytes / (us * 1e-6) / self.copy_bw

    def line(self, label: str, us: float, old_us: float | None = None, extra: str = "") -> str:
        vs = f" {old_us / us:5.2f}x old" if old_us else ""
        return f"M={self.m:<4} {self.name:8} {label:44} {us:8.1f} us {self.pct(us):6.1f} % copy{vs} {extra}"

    def w8a16(self, cfg):
        return [lambda q=q, s=s: fp8_skinny_gemm(self.x, q, s, self.gk, config=cfg) for q, s in self.ws]


def precompile(rows, sweep: bool):
    """Compile the W8A16 kernels the run times (each chosen config, plain and with its prologue fused;
    with the sweep every candidate) first, on all CPU cores (Triton's AsyncCompileMode; absent in older
    Tritons: each compiles when first timed)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    start, seen = time.perf_counter(), set()
    with ThreadPoolExecutor(os.cpu_count()) as pool, AsyncCompileMode(pool, ignore_errors=True):
        for r in rows:
            kb = r.ws[0][1].shape[1]
            cfg = config_for(r.m, r.n, r.k, kb, r.gk, r.x.device)
            if BEFORE.get(r.name):
                prologue_calls(r.m, r.k, BEFORE[r.name], r.ws[:1], r.gk, cfg, True, compile_only=True)[0]()
            by_bits(not w8a16_kernel.BF16_BY_BITS, fp8_skinny_gemm, r.x, *r.ws[0], r.gk, config=cfg, compile_only=True)
            for cfg in [cfg] + (candidate_configs(r.m, r.n, r.k, kb, r.gk) if sweep else []):
                variant = (tuple(sorted(cfg.items() - {("SPLIT_K", cfg["SPLIT_K"])})), cfg["SPLIT_K"] > 1)
                if variant not in seen:
                    seen.add(variant)
                    fp8_skinny_gemm(r.x, *r.ws[0], r.gk, config=cfg, compile_only=True)
    print(f"compiled {len(seen)} kernel variants (and the chosen ones' prologues) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def run(tokens, llama: bool, block: bool, sweep: bool):
    copy_bw, _ = measure_ceilings("cuda")
    shapes = LLAMA3_8B if llama else QWEN3_8B
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}; "
          f"{'128x128 block' if block else 'per-channel'} scales; {'Llama-3' if llama else 'Qwen3'}-8B shapes",
          flush=True)
    weights = {name: fp8_weights(n, k, 128 if block else k) for name, n, k in shapes}
    rows = [Row(m, name, n, k, 128 if block else k, weights[name], copy_bw) for m in tokens for name, n, k in shapes]
    precompile(rows, sweep)
    print("\n== 1. old path, W8A16 at the chosen config, and with the kernel before it (separate / fused)", flush=True)
    old, chosen = {}, {}
    for r in rows:
        label, fns = old_path(r.x, r.ws, r.gk)
        old[r.m, r.name] = r.time(fns)
        print(r.line(label, old[r.m, r.name]), flush=True)
        cfg = config_for(r.m, r.n, r.k, r.ws[0][1].shape[1], r.gk, r.x.device)
        chosen[r.m, r.name] = r.time(r.w8a16(cfg))
        err = rel_error(fp8_skinny_gemm(r.x, *r.ws[0], r.gk, config=cfg), r.ref)
        print(r.line(f"W8A16 chosen {short(cfg)}", chosen[r.m, r.name], old[r.m, r.name], f"err {err:.1e}"),
              flush=True)
        other = not w8a16_kernel.BF16_BY_BITS
        print(r.line(f"  same, {'bit-moving' if other else 'Triton'} bf16 conversion",
                     by_bits(other, r.time, r.w8a16(cfg)), old[r.m, r.name]), flush=True)
        before = BEFORE.get(r.name)
        if before:
            apart = r.time(prologue_calls(r.m, r.k, before, r.ws, r.gk, cfg, False))
            fused = r.time(prologue_calls(r.m, r.k, before, r.ws, r.gk, cfg, True))
            print(r.line(f"  {before} kernel + W8A16 / {before} fused", apart, extra=f"/ {fused:8.1f} us fused: "
                         f"{apart / fused:5.2f}x"), flush=True)
    best = {}
    if sweep:
        print("\n== 2. W8A16 at every candidate config", flush=True)
        times = {}
        for r in rows:
            kb = r.ws[0][1].shape[1]
            for cfg in candidate_configs(r.m, r.n, r.k, kb, r.gk):
                try:
                    us = r.time(r.w8a16(cfg), replays=5)
                    err = rel_error(fp8_skinny_gemm(r.x, *r.ws[0], r.gk, config=cfg), r.ref)
                except Exception as e:  # (a config out of shared memory or registers)
                    print(f"M={r.m:<4} {r.name:8} {short(cfg):44} skipped: {type(e).__name__}", flush=True)
                    continue
                times.setdefault((r.m, r.name), []).append((us, cfg))
                print(r.line(short(cfg), us, old[r.m, r.name], f"err {err:.1e}{'  WRONG' if err > 2e-2 else ''}"),
                      flush=True)
            if (r.m, r.name) in times:
                best[r.m, r.name] = min(times[r.m, r.name], key=lambda t: t[0])
        summarize(rows, old, chosen, best, times, block)
    return old, chosen, best


def summarize(rows, old, chosen, best, times, block: bool):
    print("\n== 3. summary: us (% copy); speed-up = old / best W8A16", flush=True)
    for r in rows:
        b = best.get((r.m, r.name))
        b_txt = f"best {b[0]:7.1f} ({r.pct(b[0]):5.1f} %) {old[r.m, r.name] / b[0]:5.2f}x  {short(b[1])}" if b else ""
        print(f"M={r.m:<4} {r.name:8} old {old[r.m, r.name]:7.1f} ({r.pct(old[r.m, r.name]):5.1f} %)  chosen "
              f"{chosen[r.m, r.name]:7.1f} ({r.pct(chosen[r.m, r.name]):5.1f} %)  {b_txt}")
    for name in dict.fromkeys(r.name for r in rows):
        wins = [m for (m, n), b in best.items() if n == name and m >= 2 and b[0] < old[m, n]]
        print(f"{name:8} best W8A16 beats the old path at M = {sorted(wins)}")
    tuned = {}
    for r in rows:  # per row bucket and shape: the least total time over the bucket's row counts >= 2
        if r.m < 2 or (r.m, r.name) not in times:
            continue
        bucket = tuned.setdefault((block_rows(r.m), r.n, r.k, block), {})
        for us, cfg in times[r.m, r.name]:
            key = tuple(sorted(cfg.items()))
            runs, total = bucket.get(key, (0, 0.0))
            bucket[key] = (runs + 1, total + us)
    print("TUNED = {")
    for key, totals in tuned.items():  # (configs timed at every row count of the bucket first)
        print(f"    {key}: {dict(min(totals, key=lambda c: (-totals[c][0], totals[c][1])))},")
    print("}", flush=True)
