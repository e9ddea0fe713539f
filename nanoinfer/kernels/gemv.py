"""y = prologue(x) @ W^T (+ bias) for one row (decode at batch 1) or a few, one Triton kernel (CUDA).

At one row a GEMM only streams its weight. On the H200 cuBLAS, with the kernel before it, took
longer than this kernel on every projection of the 0.6B and 8B shapes, the small ones most
(nanoinfer.bench.gemv compares them). Each program owns BLOCK_N output features and walks all of
K, so every weight byte is read once and no partial sums cross programs. It multiplies on CUDA
cores, so its arithmetic grows with the rows while the weight's bytes do not: past two rows the
tensor-core few-row GEMM (kernels/skinny_gemm.py) or cuBLAS is faster (layers/linear_method.py
picks).

The prologue fuses the small kernel that would otherwise run just before the GEMV:
- norm_weight: x (+ residual) through RMSNorm, with layers/layernorm.py's roundings. Every program
  computes the rows' norms itself (one extra pass over K values, from L2), and program 0 stores
  x + residual, the new residual.
- silu_mul: x is [M, 2K] (gate, up); the GEMV reads silu(gate) * up, with layers/activation.py's
  roundings.

On Hopper and later it is a programmatic dependent launch (kernels/pdl.py): it loads its first
weight tile while the kernel before it still runs, then waits for that kernel's results.
"""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.pdl import pdl_options
from nanoinfer.kernels.skinny_gemm import _input_tile_t, _rows_rstd

MAX_ROWS = 4


@triton.jit
def _input_tile(x_ptr, res_ptr, nw_ptr, rstd, rk, K, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                DTYPE: tl.constexpr):
    """One BLOCK_K slice of the GEMV's input, prologue applied, as float32 (holding a DTYPE value)."""
    mask = rk < K
    if PROLOGUE == 2:  # silu(gate) * up, silu rounded to DTYPE first
        gate = tl.load(x_ptr + rk, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + rk, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        return (act * up).to(DTYPE).to(tl.float32)
    x = tl.load(x_ptr + rk, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:  # weight * (x (+ residual), normalised and rounded to DTYPE), rounded
        if HAS_RES:
            x += tl.load(res_ptr + rk, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + rk, mask=mask, other=0.0).to(tl.float32)
        x = (w * (x * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, pid, eps, K: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """The RMSNorm prologue's 1 / rms of the row (x + residual) over all of K; program 0 also
    stores x + residual as the new residual. Shared by the GEMVs (here and kernels/fp8_gemv.py)."""
    ss = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(res_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            if pid == 0:
                tl.store(res_out_ptr + rk, x.to(DTYPE), mask=rk < K)
        ss += x * x
    return tl.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def _gemv_kernel(x_ptr, stride_x, w_ptr, b_ptr, y_ptr, stride_y, res_ptr, stride_r, res_out_ptr, nw_ptr, M, eps,
                 N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    pid = tl.program_id(0)
    DTYPE = w_ptr.dtype.element_ty
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if N * K >= 2 ** 31:  # weight offsets past int32
        rows = rn.to(tl.int64) * K
    else:
        rows = rn * K
    rk0 = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_ptr + rows[:, None] + rk0[None, :], mask=(rn[:, None] < N) & (rk0[None, :] < K), other=0.0)
    if PDL:  # the weight tile above does not depend on the previous kernel; x and residual do
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if BLOCK_M == 1:
        rstd = 0.0
        if PROLOGUE == 1:
            rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, pid, eps, K, HAS_RES, DTYPE, BLOCK_K)
        x = _input_tile(x_ptr, res_ptr, nw_ptr, rstd, rk0, K, PROLOGUE, HAS_RES, DTYPE)
        acc = tl.sum(w_first.to(tl.float32) * x[None, :], 1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = _input_tile(x_ptr, res_ptr, nw_ptr, rstd, rk, K, PROLOGUE, HAS_RES, DTYPE)
            w = tl.load(w_ptr + rows[:, None] + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(DTYPE), mask=rn < N)
    else:  # a rows axis: [BLOCK_N, BLOCK_M, BLOCK_K] products summed over K
        rm = tl.arange(0, BLOCK_M)
        rstd = tl.zeros((BLOCK_M,), tl.float32)
        if PROLOGUE == 1:
            rstd = _rows_rstd(x_ptr, stride_x, res_ptr, stride_r, res_out_ptr, rm, M, pid == 0, eps, K, HAS_RES,
                              DTYPE, 256, BLOCK_M)
        x = tl.trans(_input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk0, M, K, PROLOGUE,
                                   HAS_RES, DTYPE)).to(tl.float32)
        acc = tl.sum(w_first.to(tl.float32)[:, None, :] * x[None, :, :], 2)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            x = tl.trans(_input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk, M, K, PROLOGUE,
                                       HAS_RES, DTYPE)).to(tl.float32)
            acc += tl.sum(w.to(tl.float32)[:, None, :] * x[None, :, :], 2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], acc.to(DTYPE),
                 mask=(rn[:, None] < N) & (rm[None, :] < M))

def default_config(n: int, k: int, m: int = 1) -> dict:
    """Tiles and launch options for m rows of an [n, k] weight, from sweeps on the H200
    (nanoinfer.bench.gemv --sweep: 0.6B and 8B projections, LM heads): four output features a
    program, so that even n = 1024 spreads over the SMs; 1024-wide K tiles; 8 warps, 4 for the
    8B-sized K and for several rows. (The rows tile is the call's, not the config's.)"""
    return dict(BLOCK_N=4, BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4 if k >= 4096 or m > 1 else 8,
                num_stages=2)


def _rows_contiguous(t: torch.Tensor, m: int) -> bool:
    """One row: contiguous; several: contiguous within each row (rows may be strided)."""
    return t.is_contiguous() if m == 1 else t.stride(-1) == 1


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         residual_out: torch.Tensor | None = None, silu_mul: bool = False, config: dict | None = None,
         out: torch.Tensor | None = None):
    """x: [M, K] (silu_mul: [M, 2K]), 1 <= M <= MAX_ROWS, rows contiguous (one row: contiguous);
    weight: [N, K], contiguous. Returns y: [M, N]. With norm_weight ([K]), y = rms_norm(x (+ residual))
    @ W^T, and x + residual is stored into residual_out, a contiguous [M, K] tensor that must not
    share memory with x or residual (every program reads them while program 0 writes it). `out`: an
    [M, N] tensor with contiguous rows (one row: contiguous) to write y into."""
    N, K = weight.shape
    M = x.shape[0] if x.dim() == 2 else 0
    if not 1 <= M <= MAX_ROWS or not _rows_contiguous(x, M) or x.shape[1] != (2 * K if silu_mul else K) \
            or not weight.is_contiguous():
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows with contiguous features and a contiguous weight, got "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"gemv: norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if residual is not None:
        if norm_weight is None or residual_out is None:
            raise ValueError("gemv: a residual needs norm_weight and residual_out")
        if residual.shape != (M, K) or residual_out.shape != (M, K) or not _rows_contiguous(residual, M) \
                or not residual_out.is_contiguous():
            raise ValueError(f"gemv: residual and residual_out must be [{M}, {K}], residual_out contiguous and "
                             f"residual with contiguous rows")
        if any(residual_out.data_ptr() == t.data_ptr() for t in (x, residual)):
            raise ValueError("gemv: residual_out must not share memory with x or residual")
    if out is not None and (out.shape != (M, N) or not _rows_contiguous(out, M) or out.dtype != weight.dtype):
        raise ValueError(f"gemv: out must be [{M}, {N}] of {weight.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} of {out.dtype}")
    y = torch.empty((M, N), dtype=weight.dtype, device=x.device) if out is None else out
    cfg = dict(config or default_config(N, K, M), **pdl_options(x.device))
    cfg["BLOCK_M"] = triton.next_power_of_2(M)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, x.stride(0), weight, weight if bias is None else bias, y, y.stride(0), x if residual is None else residual,
        0 if residual is None else residual.stride(0), y if residual_out is None else residual_out,
        weight if norm_weight is None else norm_weight, M, eps,
        N=N, K=K, PROLOGUE=1 if norm_weight is not None else 2 if silu_mul else 0, HAS_RES=residual is not None,
        HAS_BIAS=bias is not None, **cfg)
    return y
