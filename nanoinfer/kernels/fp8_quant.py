"""Dynamic FP8 activation quantization in one Triton kernel (CUDA; the interpreter on CPU for
tests): x [M, K] -> float8_e4m3fn [M, K] and float32 scales [M, G], one scale per row and group of
GROUP_K features (G = ceil(K / GROUP_K); per-token scales are one group of all K). One program per
(row, group) reads its values twice (max |x|, then x / scale), the second time from L1/L2; the
torch version (quant/fp8_math.py quantize_activations) takes five passes and kernels. Both round
as kernels/fp8_round.py defines (correctly rounded float32 divisions, then e4m3 to nearest even):
the same scales and bytes."""
import torch
import triton
import triton.language as tl

from nanoinfer.kernels.fp8_round import e4m3_rounded

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@triton.jit(do_not_specialize=["stride_xm"])
def _quant_kernel(x_ptr, q_ptr, s_ptr, stride_xm, K, G, GROUP_K: tl.constexpr, BLOCK: tl.constexpr,
                  FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * K
    start = group * GROUP_K
    end = tl.minimum(start + GROUP_K, K)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(start, end, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + rk, mask=rk < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    # div_rn: Triton's float32 `/` is approximate on the GPU
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row * G + group, scale)
    for k0 in range(start, end, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + rk, mask=rk < end, other=0.0).to(tl.float32)
        q = e4m3_rounded(tl.math.div_rn(x, scale))  # (saturated to +-448)
        tl.store(q_row + rk, q.to(q_ptr.dtype.element_ty), mask=rk < end)


def quantized_outputs(m: int, k: int, group_k: int | None, out_dtype: torch.dtype, device) -> tuple:
    """(the scale group's width, empty codes [M, K], empty float32 scales [M, groups]) of quantizing an
    [M, K] input in groups of group_k features (None: one group a row)."""
    gk = k if group_k is None or group_k >= k else group_k
    return (gk, torch.empty((m, k), dtype=out_dtype, device=device),
            torch.empty((m, -(-k // gk)), dtype=torch.float32, device=device))


def quantize_fp8(x: torch.Tensor, group_k: int | None = None, min_scale: float = 1.0 / (FP8_MAX * 512.0),
                 out_dtype: torch.dtype = torch.float8_e4m3fn):
    """x [M, K] (rows contiguous) -> (float8 [M, K], float32 scales [M, ceil(K / group_k)]); group_k
    None: one scale per row. scale = max(max |group| / 448, min_scale); q = e4m3(clamp(x / scale)).
    out_dtype=float32 stores the e4m3 values before the cast to FP8."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_fp8 needs contiguous rows")
    gk, q, scale = quantized_outputs(m, k, group_k, out_dtype, x.device)
    groups = scale.shape[1]
    if m == 0:
        return q, scale
    block = min(1024, triton.next_power_of_2(gk))
    _quant_kernel[(m, groups)](x, q, scale, x.stride(0), k, groups, GROUP_K=gk, BLOCK=block, FP8_MAX=FP8_MAX,
                               MIN_SCALE=min_scale, num_warps=4 if block >= 512 else 1)
    return q, scale
