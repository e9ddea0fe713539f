"""The one definition of rounding a float to FP8 (e4m3, float8_e4m3fn), shared by every path that
writes FP8: the KV-cache store (torch and Triton), the fused qkv epilogue, and the W8A8 activation
quantization (torch and Triton). Bytes agree exactly between the torch and Triton versions, on CPU
and on the GPU:

    q = e4m3(clamp(x / s, -448, 448))

- x / s is one correctly rounded float32 division (never x * (1 / s), which differs in the last bit
  and so moves values that sit on an e4m3 rounding boundary). torch on CUDA divides by a Python
  number or a CPU scalar tensor as x * (1 / s): `div_rn` hands it a divisor on x's device instead.
  Triton's `/` on float32 is approximate on the GPU: kernels use tl.math.div_rn.
- e4m3 rounds to nearest, ties to even; e4m3 has no inf, so values are clamped to +-448 first
  (an unclamped cast would give NaN).
"""
import torch
import triton
import triton.language as tl

FP8_E4M3_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def div_rn(x: torch.Tensor, d: "torch.Tensor | float") -> torch.Tensor:
    """float32 x / d, correctly rounded on every device: d as a float32 tensor on x's device (not a
    CPU scalar, which CUDA turns into a multiplication by its reciprocal)."""
    return x.float() / torch.as_tensor(d, dtype=torch.float32, device=x.device)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 x -> float8_e4m3fn, saturated to +-448, rounded to nearest even."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3_DTYPE)


@triton.jit
def e4m3_rounded(x):
    """float32 x -> the nearest e4m3 value (ties to even, saturated to +-448), still float32, so the
    conversion to float8e4nv that follows is exact (the Triton interpreter's own fp8 rounding is
    not round-to-nearest-even). The step between e4m3 values at |x| is 2^(exponent - 3), and 2^-9
    below 2^-6 (subnormals); adding and subtracting 1.5 * 2^23 rounds |x| / step to an integer."""
    bits = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), 448.0, propagate_nan=tl.PropagateNan.ALL)  # (NaN stays NaN, as in torch)
    biased = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    step = ((biased - 3) << 23).to(tl.float32, bitcast=True)
    inv_step = ((254 - (biased - 3)) << 23).to(tl.float32, bitcast=True)  # exact, unlike a division
    r = ((a * inv_step + 12582912.0) - 12582912.0) * step
    # x's sign bit set on r, as torch keeps it: a negative value that rounds to zero is -0.0 (0x80).
    # Not -r: Triton negates as 0 - r on the GPU, which turns -0.0 into +0.0
    sign = (bits >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
