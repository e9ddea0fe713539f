"""y = prologue(x) @ W^T (+ bias) for a few rows (decode at small batch), one Triton kernel (CUDA):
kernels/gemv.py generalised from one row to up to 64.

At a few rows a GEMM only streams its weight. cuBLAS picks narrow tiles with split-K and a separate
reduce kernel there, and the kernel before it (RMSNorm, SiLU * mul) is one more launch. Here the
weight is the dot's wide side ("swap AB"): each program owns BLOCK_N output features and a slice of
K, multiplies its weight tiles with the transposed input on tensor cores ([BLOCK_N, BLOCK_K] x
[BLOCK_K, BLOCK_M], the rows padded to BLOCK_M >= 16), and so reads every weight byte once. When
the output features alone give too few programs to fill the SMs, K is split: each split stores its
float32 partial, and the split that finishes last (a per-tile arrival counter) sums them in split
order, so results do not depend on timing, writes y and resets the counter for the next call.

The prologue fuses the kernel before the GEMM, as the GEMV does (same roundings):
- norm_weight: RMSNorm of x (+ residual); every program computes the rows' 1 / rms itself (x is
  small and stays in L2) and program (0, 0) stores x + residual as the new residual.
- silu_mul: x is [M, 2K] (gate, up); the GEMM reads silu(gate) * up.

On Hopper and later it is a programmatic dependent launch (kernels/pdl.py): it loads its first
weight tile before waiting for the kernel before it.
"""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.arrival_counters import ArrivalCounters
from nanoinfer.kernels.pdl import pdl_options

MAX_ROWS = 64


@triton.jit
def _rows_rstd(x_ptr, stride_x, res_ptr, stride_r, res_out_ptr, rm, M, store_res, eps, K,
               HAS_RES: tl.constexpr, DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """1 / rms of each row (x + residual) over all of K, [BLOCK_M]; with store_res, also stores
    x + residual into the new residual (one program does)."""
    ss = tl.zeros((BLOCK_K, BLOCK_M), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = (rk[:, None] < K) & (rm[None, :] < M)
        x = tl.load(x_ptr + rm[None, :] * stride_x + rk[:, None], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(res_ptr + rm[None, :] * stride_r + rk[:, None], mask=mask, other=0.0).to(tl.float32)
            if store_res:
                tl.store(res_out_ptr + rm[None, :] * K + rk[:, None], x.to(DTYPE), mask=mask)
        ss += x * x
    return tl.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def _input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk, M, K,
                  PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr):
    """One [BLOCK_K, BLOCK_M] slice of the input, transposed, prologue applied, in DTYPE (padded
    rows and columns 0)."""
    mask = (rk[:, None] < K) & (rm[None, :] < M)
    ptrs = x_ptr + rm[None, :] * stride_x + rk[:, None]
    if PROLOGUE == 2:  # silu(gate) * up, silu rounded to DTYPE first
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        x = (act * up).to(DTYPE)
    elif PROLOGUE == 1:  # weight * (x (+ residual), normalised and rounded to DTYPE), rounded
        xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            xf += tl.load(res_ptr + rm[None, :] * stride_r + rk[:, None], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        x = (w[:, None] * (xf * rstd[None, :]).to(DTYPE).to(tl.float32)).to(DTYPE)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)
    return x


@triton.jit
def _skinny_gemm_kernel(x_ptr, stride_x, w_ptr, b_ptr, y_ptr, stride_y, res_ptr, stride_r, res_out_ptr, nw_ptr,
                        part_ptr, count_ptr, M, eps,
                        N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    DTYPE = w_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    if N * K >= 2 ** 31:  # weight offsets past int32
        rows = rn.to(tl.int64) * K
    else:
        rows = rn * K
    # a split is a whole number of K tiles, so masks compare with K alone: a compile-time constant,
    # which keeps the weight loads vectorised
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    rk = k_lo + tl.arange(0, BLOCK_K)
    w_first = tl.load(w_ptr + rows[:, None] + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
    if PDL:  # the weight tile above does not depend on the previous kernel; x and residual do
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if PROLOGUE == 1:
        rstd = _rows_rstd(x_ptr, stride_x, res_ptr, stride_r, res_out_ptr, rm, M, (pid_n == 0) & (pid_k == 0),
                          eps, K, HAS_RES, DTYPE, 256, BLOCK_M)
    x = _input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk, M, K, PROLOGUE, HAS_RES, DTYPE)
    acc = tl.dot(w_first, x, input_precision=PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        x = _input_tile_t(x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rm, rk, M, K, PROLOGUE, HAS_RES,
                          DTYPE)
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
    out_mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT_K > 1:
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
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], acc.to(DTYPE), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rm[None, :] * stride_y + rn[:, None], acc.to(DTYPE), mask=out_mask)


def default_config(m: int, n: int, k: int, element_bytes: int = 2) -> dict:
    """Tiles and launch options for M rows of an [n, k] weight of `element_bytes` elements, from
    sweeps on the H200 (nanoinfer.bench.skinny_gemm --sweep): enough programs to cover the SMs,
    splitting K when the output features alone are too few; 16-row tiles while they hold M;
    as many pipeline stages (up to 4) as fit the shared memory, which float32 tiles fill twice as
    fast. A shallow weight (k <= 1024, a small model's qkv or gate_up) is walked in a few long K
    steps, in wide tiles where its output features give enough of them; splitting its K to fill
    the SMs was slower there."""
    block_m = max(16, triton.next_power_of_2(m))
    if k <= 1024:  # (tl.dot needs K tiles of at least 16)
        block_n = 64 if triton.cdiv(n, 64) >= 48 else 32
        block_k, min_programs, max_stages = max(16, min(256, triton.next_power_of_2(k))), 48, 3
    else:
        block_n, block_k, min_programs, max_stages = 32 if n < 8192 and k <= 2048 else 64, 128, 128, 4
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < min_programs and k // (split_k * 2) >= 256:
        split_k *= 2
    stage_bytes = (block_m + block_n) * block_k * element_bytes  # one stage's x and weight tiles
    stages = max(1, min(max_stages, _STAGE_BUDGET // stage_bytes))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=stages)


# shared memory for the pipelined tiles: half the H100/H200's 227 KiB, as the norm and SiLU
# prologues' layout changes take scratch of their own (bf16 tiles always get 4 stages)
_STAGE_BUDGET = 128 * 1024


class _Workspace:
    """Per device: float32 partials for split-K and the per-tile arrival counters
    (kernels/arrival_counters.py: the last split resets its tile's). Calls on one stream are
    ordered, so one workspace serves them all. Grown when a call needs more; an outgrown buffer is
    kept, since a CUDA graph captured earlier still points at it."""

    def __init__(self):
        self.parts: dict[torch.device, torch.Tensor] = {}
        self.counters = ArrivalCounters()
        self.outgrown: list[torch.Tensor] = []

    def get(self, device, parts: int, tiles: int):
        p = self.parts.get(device)
        if p is None or p.numel() < parts:
            self.outgrown += [] if p is None else [p]
            p = self.parts[device] = torch.empty(max(parts, 1 << 18), dtype=torch.float32, device=device)
        return p, self.counters.get(device, tiles)


_WORKSPACE = _Workspace()


def check_prologue(name: str, x: torch.Tensor, M: int, K: int, norm_weight, residual, residual_out) -> None:
    """The RMSNorm prologue's arguments (this kernel's and the FP8 one's): a [K] norm weight, and a
    residual only with it and with a separate contiguous [M, K] residual_out."""
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"{name}: norm_weight must be [{K}], got {tuple(norm_weight.shape)}")
    if residual is not None:
        if norm_weight is None or residual_out is None:
            raise ValueError(f"{name}: a residual needs norm_weight and residual_out")
        if residual.shape != (M, K) or residual_out.shape != (M, K) or residual.stride(1) != 1 \
                or not residual_out.is_contiguous():
            raise ValueError(f"{name}: residual and residual_out must be [{M}, {K}] with contiguous rows")
        if any(residual_out.data_ptr() == t.data_ptr() for t in (x, residual)):
            raise ValueError(f"{name}: residual_out must not share memory with x or residual")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None, silu_mul: bool = False, config: dict | None = None,
                out: torch.Tensor | None = None):
    """x: [M, K] (silu_mul: [M, 2K]), 1 <= M <= 64, rows contiguous; weight: [N, K], contiguous.
    Returns y: [M, N]. With norm_weight ([K]), y = rms_norm(x (+ residual)) @ W^T, and x + residual
    is stored into residual_out, a contiguous [M, K] tensor that must not share memory with x or
    residual. `out`: an [M, N] tensor with contiguous rows to write y into."""
    N, K = weight.shape
    M = x.shape[0]
    if x.dim() != 2 or x.shape[1] != (2 * K if silu_mul else K) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"skinny_gemm takes rows with contiguous features and a contiguous weight, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1 to {MAX_ROWS} rows, got {M}")
    check_prologue("skinny_gemm", x, M, K, norm_weight, residual, residual_out)
    if out is not None and (out.shape != (M, N) or out.stride(1) != 1 or out.dtype != weight.dtype):
        raise ValueError(f"skinny_gemm: out must be [{M}, {N}] of {weight.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} of {out.dtype}")
    y = torch.empty((M, N), dtype=weight.dtype, device=x.device) if out is None else out
    cfg = dict(config or default_config(M, N, K, weight.element_size()))
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    parts, counts = _WORKSPACE.get(x.device, cfg["SPLIT_K"] * M * N if cfg["SPLIT_K"] > 1 else 0, tiles)
    cfg.update(pdl_options(x.device))
    _skinny_gemm_kernel[(tiles, cfg["SPLIT_K"])](
        x, x.stride(0), weight, weight if bias is None else bias, y, y.stride(0),
        x if residual is None else residual, 0 if residual is None else residual.stride(0),
        y if residual_out is None else residual_out, weight if norm_weight is None else norm_weight,
        parts, counts, M, eps, N=N, K=K, PROLOGUE=1 if norm_weight is not None else 2 if silu_mul else 0,
        HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",  # (float32: no TF32 rounding)
        K_SPLIT=triton.cdiv(triton.cdiv(K, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"], **cfg)
    return y
