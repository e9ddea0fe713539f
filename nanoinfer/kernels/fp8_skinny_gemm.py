"""y = prologue(x) @ (W * scales)^T (+ bias) for a few rows, W float8_e4m3fn and x in the model's dtype
(W8A16), one Triton kernel (CUDA; the interpreter on CPU for tests): the FP8 counterpart of
kernels/skinny_gemm.py, as kernels/fp8_gemv.py is of kernels/gemv.py.

Why weight-only at a few rows: W8A8 (kernels/fp8_gemm.py) first quantizes the activations in a kernel
of its own, one more launch per linear layer that, at these row counts, is bound by its launch and its
few programs rather than by bytes. Here the activations are read as they are: each FP8 weight tile is
converted to x's dtype in registers and multiplied on the 16-bit tensor cores. At these rows the
weight's bytes are the cost, so the conversion is hidden behind them. The result is that of the
dequantized model (unquantized activations, as the CPU path computes) up to summation order and the
scales being applied to sums rather than to each weight.

Tiling as the few-row GEMM: the weight is the dot's wide side ("swap AB"): each program owns BLOCK_N
output features and a slice of K and multiplies [BLOCK_N, BLOCK_K] weight tiles with the transposed
input [BLOCK_K, BLOCK_M] (rows padded to BLOCK_M >= 16), so every weight byte is read once. When the
output features alone give too few programs to fill the SMs, K is split: each split stores its float32
partial and the split that arrives last (a per-tile arrival counter) sums them in split order, so the
result does not depend on timing (deterministic, no host sync, CUDA-graph capturable).

Scales are float32 [N, KB] (quant/fp8_scheme.py). One column (per channel, per tensor): the finished
sum is scaled in the epilogue. Several (block scales, GROUP_K input features each): BLOCK_K divides
GROUP_K, so each tile lies in one group, and its product is scaled by its group's scales before it is
added.

The prologue (RMSNorm with the residual add, or SiLU * mul) is the few-row GEMM's, same roundings; on
Hopper and later the kernel is a programmatic dependent launch (kernels/pdl.py).

Tile configs: `config_for` looks up TUNED, a table filled from the H100 benchmark
(`python -m nanoinfer.bench.fp8 --w8a16` prints the measured best per (row bucket, N, K) as a TUNED
literal), and falls back to `default_config`'s rule for shapes not in it. A table rather than a timed
choice at start-up: start-up stays short, and the first run does not tune. N, K and the split count are
runtime arguments, so the compiled variants are one per tile shape (not per layer shape), and M is
never specialised on (CUDA-graph buckets and eager steps share them)."""
import functools

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.pdl import pdl_options
from nanoinfer.kernels.skinny_gemm import _WORKSPACE, _input_tile_t, _rows_rstd, check_prologue

MAX_ROWS = 128
# bfloat16 activations on CUDA: the FP8 weight converted by moving bits (_e4m3_to_bf16), not by Triton's
# conversion (the benchmark times both: `python -m nanoinfer.bench.fp8 --w8a16`)
BF16_BY_BITS = True


@triton.jit
def _e4m3_to_bf16(w):
    """FP8 e4m3 codes to bfloat16: to float16 in Triton's packed conversion (two codes an instruction),
    then float16 to bfloat16 by moving bits, two values a 32-bit word: sign kept, exponent and
    mantissa shifted under bfloat16's (exact: an e4m3 value is a normal float16 with 3 mantissa bits,
    which lands as a normal bfloat16 2^-112 times it), times 2^112 in one bfloat16x2 multiply. Triton
    converts float16 to bfloat16 one value per conversion instruction, and those issue at a quarter of
    the integer ALUs' rate: at these row counts they cost as much time as the weight's bytes. (A NaN
    code turns into a finite value: quantized weights hold none.)"""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, t, z;
        shr.b32 s, $1, 3;
        and.b32 s, s, 0x0FFF0FFF;
        and.b32 t, $1, 0x80008000;
        or.b32 s, s, t;
        mov.b32 t, 0x77807780;
        mov.b32 z, 0x80008000;
        fma.rn.bf16x2 $0, s, t, z;
        }""",
        constraints="=r,r", args=[w.to(tl.float16)], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _add_tile(acc, w, x, s_ptr, rn, n_mask, k0, KB, BLOCK_SCALES: tl.constexpr, GROUP_K: tl.constexpr,
              PRECISION: tl.constexpr, BF16_BITS: tl.constexpr):
    """acc + one FP8 weight tile [BLOCK_N, BLOCK_K], converted to x's dtype, times x [BLOCK_K, BLOCK_M];
    with block scales, the tile's product times its group's scales."""
    if BF16_BITS:
        wx = _e4m3_to_bf16(w)
    else:
        wx = w.to(x.dtype)
    if not BLOCK_SCALES:
        acc = tl.dot(wx, x, acc, input_precision=PRECISION)
    else:
        s = tl.load(s_ptr + rn * KB + k0 // GROUP_K, mask=n_mask, other=0.0)
        acc += tl.dot(wx, x, input_precision=PRECISION) * s[:, None]
    return acc


@triton.jit
def _store_rows(acc, y_ptr, stride_y, s_ptr, b_ptr, rn, rm, n_mask, out_mask, BLOCK_SCALES: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """The epilogue: one scale column applied, the bias added, y^T tile stored in y's dtype."""
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M", "SPLIT_K", "KB", "eps"])
def _fp8_skinny_gemm_kernel(x_ptr, stride_x, w_ptr, s_ptr, b_ptr, y_ptr, stride_y, res_ptr, stride_r, res_out_ptr,
                            nw_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, SPLIT_K, KB, eps,
                            BLOCK_SCALES: tl.constexpr, GROUP_K: tl.constexpr, PROLOGUE: tl.constexpr,
                            HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                            PRECISION: tl.constexpr, BF16_BITS: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    DTYPE = y_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    # a split is a whole number of K tiles (the wrapper launches no empty split)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    rk = k_lo + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    w_first = tl.load(w_ptrs, mask=n_mask[:, None] & (rk[None, :] < K), other=0.0)
    if PDL:  # the weight tile above does not depend on the previous kernel; x and residual do
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if PROLOGUE == 1:
        rstd = _rows_rstd(x_ptr, stride_x, res_ptr, stride_r, res_out_ptr, rm, M, (pid_n == 0) & (pid_k == 0),
                          eps, K, HAS_RES, DTYPE, 256, BLOCK_M)
    x = _input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk, M, K, PROLOGUE, HAS_RES, DTYPE)
    acc = _add_tile(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), w_first, x, s_ptr, rn, n_mask, k_lo, KB,
                    BLOCK_SCALES, GROUP_K, PRECISION, BF16_BITS)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & (rk[None, :] < K), other=0.0)
        x = _input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk, M, K, PROLOGUE, HAS_RES, DTYPE)
        acc = _add_tile(acc, w, x, s_ptr, rn, n_mask, k0, KB, BLOCK_SCALES, GROUP_K, PRECISION, BF16_BITS)
    out_mask = n_mask[:, None] & (rm[None, :] < M)
    if SPLIT:
        # store this split's partial, then count arrivals: the last split to arrive sums all of them
        part = part_ptr + rm[None, :] * N + rn[:, None]
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in range(SPLIT_K):  # in split order: the sum does not depend on arrival order
                acc += tl.load(part + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_rows(acc, y_ptr, stride_y, s_ptr, b_ptr, rn, rm, n_mask, out_mask, BLOCK_SCALES, HAS_BIAS)
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        _store_rows(acc, y_ptr, stride_y, s_ptr, b_ptr, rn, rm, n_mask, out_mask, BLOCK_SCALES, HAS_BIAS)


# shared memory for the pipelined tiles (an FP8 weight tile and a 16-bit input tile a stage), with room
# left for the prologues' layout changes, as kernels/skinny_gemm.py
_STAGE_BUDGET = 128 * 1024
# The measured best tiles: {(BLOCK_M, N, K, block scales): config}, from the H100 benchmark's TUNED
# literal (`python -m nanoinfer.bench.fp8 --w8a16`). Shapes not here take default_config.
TUNED: dict[tuple[int, int, int, bool], dict] = {  # Qwen3-8B's projections at tp=1, per channel
    (16, 6144, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 16, 'BLOCK_N': 32, 'SPLIT_K': 2, 'num_stages': 4, 'num_warps': 4},
    (16, 4096, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 16, 'BLOCK_N': 64, 'SPLIT_K': 4, 'num_stages': 4, 'num_warps': 4},
    (16, 24576, 4096, False): {'BLOCK_K': 256, 'BLOCK_M': 16, 'BLOCK_N': 64, 'SPLIT_K': 1, 'num_stages': 4, 'num_warps': 4},
    (16, 4096, 12288, False): {'BLOCK_K': 256, 'BLOCK_M': 16, 'BLOCK_N': 64, 'SPLIT_K': 2, 'num_stages': 4, 'num_warps': 4},
    (32, 6144, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 32, 'BLOCK_N': 64, 'SPLIT_K': 4, 'num_stages': 4, 'num_warps': 4},
    (32, 4096, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 32, 'BLOCK_N': 64, 'SPLIT_K': 2, 'num_stages': 4, 'num_warps': 4},
    (32, 24576, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 32, 'BLOCK_N': 64, 'SPLIT_K': 1, 'num_stages': 4, 'num_warps': 4},
    (32, 4096, 12288, False): {'BLOCK_K': 256, 'BLOCK_M': 32, 'BLOCK_N': 64, 'SPLIT_K': 2, 'num_stages': 4, 'num_warps': 4},
    (64, 6144, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 64, 'BLOCK_N': 64, 'SPLIT_K': 1, 'num_stages': 4, 'num_warps': 4},
    (64, 4096, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 64, 'BLOCK_N': 64, 'SPLIT_K': 2, 'num_stages': 4, 'num_warps': 4},
    (64, 24576, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 64, 'BLOCK_N': 64, 'SPLIT_K': 1, 'num_stages': 4, 'num_warps': 4},
    (64, 4096, 12288, False): {'BLOCK_K': 128, 'BLOCK_M': 64, 'BLOCK_N': 64, 'SPLIT_K': 4, 'num_stages': 4, 'num_warps': 4},
    (128, 6144, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 128, 'BLOCK_N': 64, 'SPLIT_K': 1, 'num_stages': 3, 'num_warps': 8},
    (128, 4096, 4096, False): {'BLOCK_K': 128, 'BLOCK_M': 128, 'BLOCK_N': 64, 'SPLIT_K': 2, 'num_stages': 3, 'num_warps': 8},
    (128, 24576, 4096, False): {'BLOCK_K': 64, 'BLOCK_M': 128, 'BLOCK_N': 128, 'SPLIT_K': 1, 'num_stages': 4, 'num_warps': 8},
    (128, 4096, 12288, False): {'BLOCK_K': 64, 'BLOCK_M': 128, 'BLOCK_N': 128, 'SPLIT_K': 4, 'num_stages': 4, 'num_warps': 8},
}


def block_rows(m: int) -> int:
    """The rows tile for m rows (the row bucket configs are keyed by): a power of two >= 16."""
    return max(16, triton.next_power_of_2(m))


def max_block_k(group_k: int, kb: int) -> int:
    """The widest K tile the scales allow: 256, or with block scales the largest power of two <= 256
    dividing group_k (0 when it is below the dot's 16)."""
    if kb == 1:
        return 256
    tile = 256
    while tile >= 16 and group_k % tile:
        tile //= 2
    return tile if tile >= 16 else 0


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (an H100's 132 for the CPU interpreter)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(block_m: int, block_n: int, block_k: int) -> dict | None:
    """Warps and pipeline stages for a tile: as many stages (2-4) as fit the shared-memory budget, None
    when not even two do; eight warps for a large accumulator."""
    stages = min(4, _STAGE_BUDGET // (block_n * block_k + 2 * block_m * block_k))
    if stages < 2:
        return None
    return dict(num_warps=8 if block_n * block_m >= 8192 else 4, num_stages=stages)


def default_config(m: int, n: int, k: int, kb: int, group_k: int, sms: int = 132) -> dict:
    """The rule for shapes TUNED lacks, aiming at two programs an SM: 128-wide K tiles; output-feature
    tiles twice the rows tile (32-128), so that a program reads no more bytes of x (again from L2 for
    each weight tile) than of its weight, narrowed while even the most splits leave fewer programs;
    then K split in two, four or eight as needed, as long as a split keeps two K tiles and the float32
    partials (written and read once) stay under half the weight's bytes."""
    block_m = block_rows(m)
    block_k = min(128, max_block_k(group_k, kb))
    most = 1
    while most < 8 and k // (2 * most) >= 2 * block_k and 2 * most * m * 16 <= k:
        most *= 2
    block_n = min(128, 2 * block_m)
    while block_n > 32 and triton.cdiv(n, block_n) * most < 2 * sms:
        block_n //= 2
    tiles, split_k = triton.cdiv(n, block_n), 1
    while tiles * split_k < 2 * sms and split_k < most:
        split_k *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                **launch_options(block_m, block_n, block_k))


def candidate_configs(m: int, n: int, k: int, kb: int, group_k: int) -> list[dict]:
    """The configs the benchmark times for one shape: 32/64/128-feature tiles, 64/128/256-wide K tiles
    (dividing group_k with block scales), K in 1, 2 or 4 splits of at least two K tiles each."""
    block_m, widest = block_rows(m), max_block_k(group_k, kb)
    out = []
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256):
            opts = launch_options(block_m, block_n, block_k)
            if block_k > widest or opts is None:
                continue
            for split_k in (1, 2, 4):
                if split_k == 1 or k // split_k >= 2 * block_k:
                    out.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, **opts))
    return out


def config_for(m: int, n: int, k: int, kb: int, group_k: int, device: torch.device) -> dict:
    """The tiles for m rows of an [n, k] weight: TUNED's entry for the row bucket and shape, else the rule."""
    tuned = TUNED.get((block_rows(m), n, k, kb > 1))
    if tuned is not None and (kb == 1 or group_k % tuned["BLOCK_K"] == 0):
        return dict(tuned)
    return default_config(m, n, k, kb, group_k, sm_count(device))


def supports(group_k: int, kb: int) -> bool:
    """Whether the kernel takes these scales: one column, or groups with a power-of-two divisor >= 16."""
    return max_block_k(group_k, kb) > 0


def fp8_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int,
                    bias: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                    silu_mul: bool = False, config: dict | None = None, out: torch.Tensor | None = None,
                    compile_only: bool = False) -> torch.Tensor:
    """x: [M, K] (silu_mul: [M, 2K]) of bfloat16, float16 or float32, 1 <= M <= MAX_ROWS, rows contiguous;
    weight: float8_e4m3fn [N, K], contiguous; scale: float32 [N, ceil(K / group_k)], contiguous.
    Returns y [M, N] in x's dtype. The prologue arguments and `out` as kernels/skinny_gemm.py's.
    compile_only: compile the kernel for this call without running it (y is left unwritten), as the
    benchmark does for its candidate configs, several at a time."""
    N, K = weight.shape
    M = x.shape[0] if x.dim() == 2 else 0
    if x.dim() != 2 or x.shape[1] != (2 * K if silu_mul else K) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"fp8_skinny_gemm takes rows with contiguous features and a contiguous weight, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"fp8_skinny_gemm takes 1 to {MAX_ROWS} rows, got {M}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_skinny_gemm: x must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"fp8_skinny_gemm: weight must be float8_e4m3fn and scale float32, got {weight.dtype}, "
                         f"{scale.dtype}")
    kb = -(-K // group_k)
    if scale.shape != (N, kb) or not scale.is_contiguous():
        raise ValueError(f"fp8_skinny_gemm: scale must be contiguous [{N}, {kb}], got {tuple(scale.shape)}")
    if not supports(group_k, kb):
        raise ValueError(f"fp8_skinny_gemm: block scales over group_k={group_k} features need a power-of-two "
                         "divisor >= 16")
    check_prologue("fp8_skinny_gemm", x, M, K, norm_weight, residual, residual_out)
    if out is not None and (out.shape != (M, N) or out.stride(1) != 1 or out.dtype != x.dtype):
        raise ValueError(f"fp8_skinny_gemm: out must be [{M}, {N}] of {x.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} of {out.dtype}")
    cfg = dict(config or config_for(M, N, K, kb, group_k, x.device))
    if cfg["BLOCK_M"] < M or (kb > 1 and group_k % cfg["BLOCK_K"]):
        raise ValueError(f"fp8_skinny_gemm: config {cfg} does not tile {M} rows or group_k={group_k}")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    k_split = triton.cdiv(triton.cdiv(K, cfg.pop("SPLIT_K")), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = triton.cdiv(K, k_split)  # (no empty split: each holds at least one K tile)
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    parts, counts = _WORKSPACE.get(x.device, split_k * M * N if split_k > 1 else 0, tiles)
    cfg.update(pdl_options(x.device))
    kernel = _fp8_skinny_gemm_kernel[(tiles, split_k)]
    if compile_only:
        kernel = functools.partial(_fp8_skinny_gemm_kernel.warmup, grid=(tiles, split_k))
    kernel(
        x, x.stride(0), weight, scale, scale if bias is None else bias, y, y.stride(0),
        x if residual is None else residual, 0 if residual is None else residual.stride(0),
        y if residual_out is None else residual_out, scale if norm_weight is None else norm_weight,
        parts, counts, M, N, K, k_split, split_k, kb, eps, BLOCK_SCALES=kb > 1, GROUP_K=group_k if kb > 1 else 1,
        PROLOGUE=1 if norm_weight is not None else 2 if silu_mul else 0, HAS_RES=residual is not None,
        HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # (float32: no TF32 rounding)
        BF16_BITS=BF16_BY_BITS and x.dtype == torch.bfloat16 and x.device.type == "cuda" and torch.version.hip is None,
        **cfg)  # (the bit-moving conversion is NVIDIA PTX)
    return y
