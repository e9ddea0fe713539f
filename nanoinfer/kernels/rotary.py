"""Rotary embedding applied in place to rows of heads, with a per-row cos/sin table: one Triton
kernel (CUDA) for what layers/rotary_embedding.py's `apply_rotary` does in six eager passes. The
vision towers use it: their tables are per patch (2D positions), not per token position.
Roundings follow `apply_rotary`: float32 arithmetic, the result rounded to the input dtype."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_kernel(x_ptr, cs_ptr, stride_xn, stride_xh, stride_cs, H, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + row * stride_cs + d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + row * stride_cs + HALF + d, mask=d_mask, other=0.0)[None, :]
    mask = (heads[:, None] < H) & d_mask[None, :]
    ptr = x_ptr + row * stride_xn + heads[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    DTYPE = x_ptr.dtype.element_ty
    tl.store(ptr, (x1 * cos - x2 * sin).to(DTYPE), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(DTYPE), mask=mask)


def rotate_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] (a view is fine: its last dimension contiguous), rotated in place,
    NeoX style (the two halves of each head); cos_sin: float32 [N, head_dim], cos then sin."""
    n, heads, dim = x.shape
    if x.stride(2) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("rotate_: x and cos_sin need a contiguous last dimension")
    if cos_sin.shape != (n, dim) or cos_sin.dtype != torch.float32:
        raise ValueError(f"rotate_: cos_sin must be float32 [{n}, {dim}], got {cos_sin.dtype} {list(cos_sin.shape)}")
    if n:
        half = dim // 2
        block_h = min(triton.next_power_of_2(heads), max(1, 4096 // triton.next_power_of_2(half)))
        _rotate_kernel[(n, triton.cdiv(heads, block_h))](
            x, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), heads, HALF=half,
            HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h, num_warps=4)
    return x
