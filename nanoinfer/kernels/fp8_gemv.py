"""y = prologue(x) @ (W * scales)^T (+ bias) for one row, W float8_e4m3fn: the FP8 counterpart of
kernels/gemv.py (same tiling, prologue and programmatic dependent launch), reading one byte per
weight. Activations stay in the model's dtype (weight-only at one row: the weight read is the cost).

Scales are float32 [N, KB], one row per output feature, each column over GROUP_K input features
(quant/fp8_scheme.py). With one column (per-channel or per-tensor) the row's dot product is scaled
once at the end; otherwise each K tile, a whole number of groups, is summed per group and scaled."""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.gemv import _input_tile, _row_rstd
from nanoinfer.kernels.pdl import pdl_options


@triton.jit
def _scaled_tile_sum(w, x, s_ptr, rn, n_mask, k0, KB: tl.constexpr, GROUP_K: tl.constexpr, GROUPS: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] FP8 tile's dot products with x: per row (one scale column: scaled by the
    caller at the end), or per group of GROUP_K features times that group's scale."""
    prod = w.to(tl.float32) * x[None, :]
    # (one return, after a constexpr if/else: the compiler would type-check code after an early return)
    if KB == 1:
        total = tl.sum(prod, 1)
    else:
        part = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, GROUP_K)), 2)
        cols = k0 // GROUP_K + tl.arange(0, GROUPS)
        s = tl.load(s_ptr + rn[:, None] * KB + cols[None, :], mask=n_mask[:, None] & (cols[None, :] < KB),
                    other=0.0)
        total = tl.sum(part * s, 1)
    return total


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_ptr, res_out_ptr, nw_ptr, eps,
                     N: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, GROUP_K: tl.constexpr,
                     GROUPS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    DTYPE = y_ptr.dtype.element_ty
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    if N * K >= 2 ** 31:
        rows = rn.to(tl.int64) * K
    else:
        rows = rn * K
    rk0 = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_ptr + rows[:, None] + rk0[None, :], mask=n_mask[:, None] & (rk0[None, :] < K), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, pid, eps, K, HAS_RES, DTYPE, BLOCK_K)
    x = _input_tile(x_ptr, res_ptr, nw_ptr, rstd, rk0, K, PROLOGUE, HAS_RES, DTYPE)
    acc = _scaled_tile_sum(w_first, x, s_ptr, rn, n_mask, 0, KB, GROUP_K, GROUPS, BLOCK_N)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        rk = k0 + rk0
        x = _input_tile(x_ptr, res_ptr, nw_ptr, rstd, rk, K, PROLOGUE, HAS_RES, DTYPE)
        w = tl.load(w_ptr + rows[:, None] + rk[None, :], mask=n_mask[:, None] & (rk[None, :] < K), other=0.0)
        acc += _scaled_tile_sum(w, x, s_ptr, rn, n_mask, k0, KB, GROUP_K, GROUPS, BLOCK_N)
    if KB == 1:
        acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, acc.to(DTYPE), mask=n_mask)


def supports(scale: torch.Tensor, group_k: int) -> bool:
    """Whether the kernel takes these scales: one column, or power-of-two groups."""
    return scale.shape[1] == 1 or (group_k & (group_k - 1) == 0 and group_k <= 1024)


def default_config(n: int, k: int, group_k: int, kb: int) -> dict:
    """From a sweep on the H200 at the 8B projections with the engine's prologues (tiles of 4-16
    rows, 1-4K columns, 4/8 warps, 2/3 stages): eight output features a program over K tiles of up
    to 4096 bytes, which keeps twice the bytes in flight a program of kernels/gemv.py's bf16 tiles;
    four features when eight would leave fewer than two programs an SM (the 0.6B shapes). With block
    scales the K tile is a whole number of groups."""
    block_k = min(4096, triton.next_power_of_2(k))
    if kb > 1:
        block_k = max(block_k, group_k)
    block_n = 8 if n >= 8 * 2 * 132 else 4
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int,
             bias: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, silu_mul: bool = False,
             config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] (silu_mul: [1, 2K]) in the model's dtype; weight: float8 [N, K]; scale: float32
    [N, ceil(K / group_k)]. Returns y [1, N] in x's dtype; the prologue arguments as kernels/gemv.py's."""
    N, K = weight.shape
    kb = scale.shape[1]
    if x.shape != (1, 2 * K if silu_mul else K) or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"fp8_gemv takes one contiguous row and a contiguous weight, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemv: weight must be float8_e4m3fn and scale float32, got {weight.dtype}, {scale.dtype}")
    if scale.shape != (N, -(-K // group_k)) or not scale.is_contiguous():
        raise ValueError(f"fp8_gemv: scale must be contiguous [{N}, {-(-K // group_k)}], got {tuple(scale.shape)}")
    if not supports(scale, group_k):
        raise ValueError(f"fp8_gemv: group_k={group_k} must be a power of two <= 1024 with several scale columns")
    if residual is not None and (norm_weight is None or residual_out is None):
        raise ValueError("fp8_gemv: a residual needs norm_weight and residual_out")
    if out is not None and (out.shape != (1, N) or not out.is_contiguous() or out.dtype != x.dtype):
        raise ValueError(f"fp8_gemv: out must be contiguous [1, {N}] of {x.dtype}, got {tuple(out.shape)} "
                         f"of {out.dtype}")
    y = torch.empty((1, N), dtype=x.dtype, device=x.device) if out is None else out
    cfg = dict(config or default_config(N, K, group_k, kb), **pdl_options(x.device))
    _fp8_gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, weight, scale, scale if bias is None else bias, y, x if residual is None else residual,
        y if residual_out is None else residual_out, scale if norm_weight is None else norm_weight, eps,
        N=N, K=K, KB=kb, GROUP_K=group_k,
        GROUPS=cfg["BLOCK_K"] // group_k if kb > 1 else 1,
        PROLOGUE=1 if norm_weight is not None else 2 if silu_mul else 0,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, **cfg)
    return y
