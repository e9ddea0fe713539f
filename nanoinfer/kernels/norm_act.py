"""RMSNorm (optionally fused with the residual add) and SiLU * mul, one Triton kernel each (CUDA).

They replace torch.compile'd versions: same fusion on the device, but a Triton launch costs the
host a fraction of what a torch.compile'd region with dynamic shapes does (guards, wrappers), and
eager steps (prefill, mixed) run 3 of them per layer. Roundings follow the torch functions in
layers/layernorm.py and layers/activation.py, which stay the CPU path and the test reference:
float32 arithmetic, the normalised value rounded to the input dtype before the weight multiply,
silu(gate) rounded before the multiply by up.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    DTYPE = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # residual += x (stored in dtype); the norm reads the float32 sum, as add_rms_norm
        x += tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * stride_ro + offs, x.to(DTYPE), mask=mask)
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = w * (x * r).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(DTYPE), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [T, N]. Without residual returns weight * norm(x); with it, (weight * norm(x + residual),
    x + residual)."""
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if T:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(T,)](x, residual if residual is not None else x, weight, out, res_out,
                               x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
                               res_out.stride(0), eps, N=N, BLOCK=block, HAS_RES=residual is not None,
                               num_warps=min(max(block // 256, 1), 8))
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    DTYPE = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(DTYPE), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * N] (gate, up) -> silu(gate) * up, [T, N]."""
    T, two_n = x.shape
    N = two_n // 2
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        block = min(triton.next_power_of_2(N), 1024)
        _silu_mul_kernel[(T, triton.cdiv(N, block))](x, out, x.stride(0), out.stride(0), N=N, BLOCK=block,
                                                      num_warps=4)
    return out
