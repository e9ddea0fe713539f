"""The elementwise step before an FP8 W8A8 product, fused with the product's per-token activation
quantization (CUDA; the interpreter on CPU for tests): RMSNorm (with the residual add, storing the
new residual) or SiLU * mul, then FP8 codes and scales, in one kernel instead of two (vLLM's
fuse_norm_quant / fuse_act_quant passes do the same). The values quantized are the step's own
outputs, rounded to the model's dtype as layers/layernorm.py and layers/activation.py round them,
then quantized as kernels/fp8_quant.py does: the same codes and scales as the two kernels, up to
the norm's float32 summation order.

One program per (row, scale group) walks its row up to three times (the norm's sum of squares,
the group's max |value|, the codes); the later walks read from L1/L2.

Not run by default: quant/fp8_linear.py's FUSED_QUANT_MAX_ROWS is 0 (it measured slower than the two
kernels), and the few rows it was meant for now take W8A16 (kernels/fp8_skinny_gemm.py), which
quantizes no activations; only rows past W8A16_MAX_ROWS could reach it."""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.fp8_quant import FP8_MAX, quantized_outputs
from nanoinfer.kernels.fp8_round import e4m3_rounded


@triton.jit
def _step_values(x_row, res_row, nw_ptr, rk, mask, rstd, K, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                 DTYPE: tl.constexpr):
    """The step's outputs at features rk, rounded to DTYPE, as float32."""
    if PROLOGUE == 2:  # silu(gate) * up, silu rounded first
        gate = tl.load(x_row + rk, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + rk, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        return (act * up).to(DTYPE).to(tl.float32)
    x = tl.load(x_row + rk, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_row + rk, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(nw_ptr + rk, mask=mask, other=0.0).to(tl.float32)
    return (w * (x * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["stride_xm", "stride_rm"])
def _prologue_quant_kernel(x_ptr, stride_xm, res_ptr, stride_rm, res_out_ptr, nw_ptr, q_ptr, s_ptr, eps, K, G,
                           PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, GROUP_K: tl.constexpr,
                           BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    DTYPE = res_out_ptr.dtype.element_ty  # (the model's dtype: x's)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    res_row = res_ptr + row.to(tl.int64) * stride_rm
    rstd = 0.0
    if PROLOGUE == 1:  # 1 / rms of the row (x + residual); group 0 stores the new residual
        ss = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            if HAS_RES:
                x += tl.load(res_row + rk, mask=rk < K, other=0.0).to(tl.float32)
                if group == 0:
                    tl.store(res_out_ptr + row.to(tl.int64) * K + rk, x.to(DTYPE), mask=rk < K)
            ss += x * x
        rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
    start = group * GROUP_K
    end = tl.minimum(start + GROUP_K, K)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(start, end, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        v = _step_values(x_row, res_row, nw_ptr, rk, rk < end, rstd, K, PROLOGUE, HAS_RES, DTYPE)
        amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row * G + group, scale)
    q_row = q_ptr + row.to(tl.int64) * K
    for k0 in range(start, end, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        v = _step_values(x_row, res_row, nw_ptr, rk, rk < end, rstd, K, PROLOGUE, HAS_RES, DTYPE)
        tl.store(q_row + rk, e4m3_rounded(tl.math.div_rn(v, scale)).to(q_ptr.dtype.element_ty), mask=rk < end)


def quantize_fp8_after(x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                       residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       silu_mul: bool = False, group_k: int | None = None,
                       min_scale: float = 1.0 / (FP8_MAX * 512.0),
                       out_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """The pending step on x, then quantize_fp8 (kernels/fp8_quant.py) of its result: (float8 [M, K],
    float32 scales [M, ceil(K / group_k)]; group_k None: one scale a row). norm_weight [K]: RMSNorm of
    x (+ residual, whose sum is stored into residual_out, contiguous [M, K], sharing no memory with x
    or residual); silu_mul: x is [M, 2K] (gate, up). x and residual need contiguous rows.
    out_dtype=float32 stores the e4m3 values before the cast to FP8 (as quantize_fp8)."""
    m = x.shape[0]
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    if silu_mul == (norm_weight is not None) or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("quantize_fp8_after: either norm_weight or silu_mul, and x [M, K] with contiguous rows")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"quantize_fp8_after: norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual_out is None or residual.shape != (m, k) or residual.stride(1) != 1
                                 or residual_out.shape != (m, k) or not residual_out.is_contiguous()
                                 or residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr())):
        raise ValueError(f"quantize_fp8_after: residual and residual_out [{m}, {k}] (residual_out contiguous, "
                         "its own memory)")
    gk, q, scale = quantized_outputs(m, k, group_k, out_dtype, x.device)
    groups = scale.shape[1]
    if m == 0:
        return q, scale
    block = min(1024, triton.next_power_of_2(gk))
    res_out = residual_out if residual_out is not None else torch.empty((1,), dtype=x.dtype, device=x.device)
    _prologue_quant_kernel[(m, groups)](
        x, x.stride(0), x if residual is None else residual, 0 if residual is None else residual.stride(0), res_out,
        x if norm_weight is None else norm_weight, q, scale, eps, k, groups,
        PROLOGUE=2 if silu_mul else 1, HAS_RES=residual is not None, GROUP_K=gk, BLOCK=block, FP8_MAX=FP8_MAX,
        MIN_SCALE=min_scale, num_warps=4 if block >= 512 else 1)
    return q, scale
