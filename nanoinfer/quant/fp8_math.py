"""FP8 arithmetic in torch: the checkpoint scales turned into one row of scales per output feature
(and their tensor-parallel share), online per-channel quantization, dequantization, and the dynamic
activation scales of W8A8 (per token, or per token and K group). Every division and rounding to
e4m3 is kernels/fp8_round.py's (clamped to +-448, correctly rounded divisions), so the Triton
activation quantization (kernels/fp8_quant.py) writes the same bytes as these on the GPU."""
import torch

from nanoinfer.kernels.fp8_round import div_rn, to_e4m3
from nanoinfer.quant.fp8_scheme import FP8_MAX, Fp8Scheme
from nanoinfer.utils.loader import check_shape

# the smallest scale: an all-zero row (or group) divides by this instead of by zero
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_k(scheme: Fp8Scheme, in_features: int) -> int:
    """How many input features share a scale column: block_k for block scales, else all of them."""
    return scheme.block[1] if scheme.strategy == "block" else in_features


def scale_rows(scheme: Fp8Scheme, loaded: torch.Tensor, out_full: int, in_full: int) -> torch.Tensor:
    """A checkpoint tensor's scales, shape-checked against its full (unsharded) weight [out_full,
    in_full], as float32 [out_full, scale columns]: block rows repeated over their block_n rows
    (the last block partial), a per-tensor scale over every row."""
    if scheme.strategy == "block":
        bn, bk = scheme.block
        check_shape(loaded, (cdiv(out_full, bn), cdiv(in_full, bk)))
        return loaded.float().repeat_interleave(bn, 0)[:out_full]
    if scheme.strategy == "channel":
        if loaded.dim() == 1:
            loaded = loaded[:, None]
        check_shape(loaded, (out_full, 1))
        return loaded.float()
    if loaded.numel() != 1 or loaded.dim() > 1:
        raise ValueError(f"size mismatch: expected one per-tensor scale (shape [] or [1]), found {list(loaded.shape)}")
    return loaded.float().reshape(1, 1).expand(out_full, 1)


def check_block_cut(scheme: Fp8Scheme, start: int, size: int, full: int, dim: int, what: str):
    """Refuse a tensor-parallel share [start, start + size) of `full` features that cuts a scale block
    (dim 0: block_n along output features, 1: block_k along input features)."""
    if scheme.strategy != "block" or size == full:
        return
    block = scheme.block[dim]
    if start % block or (size % block and start + size != full):
        raise ValueError(f"tensor parallelism cuts {what} features [{start}, {start + size}) of {full}, which "
                         f"splits a {scheme.block[0]}x{scheme.block[1]} FP8 scale block (weight_block_size); "
                         f"use a tensor_parallel_size whose shares are multiples of {block}")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online per-output-channel FP8: (float8 [N, K], float32 scales [N, 1]), scale = max |row| / 448."""
    w = weight.float()
    scale = div_rn(w.abs().amax(dim=1, keepdim=True), FP8_MAX).clamp_(min=MIN_SCALE)
    return to_e4m3(div_rn(w, scale)), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, gk: int, dtype: torch.dtype) -> torch.Tensor:
    """float8 [..., N, K] times its scales [..., N, ceil(K / gk)], each scale over gk input features,
    computed in float32 and rounded once to `dtype`."""
    k = weight.shape[-1]
    return (weight.float() * scale.float().repeat_interleave(gk, -1)[..., :k]).to(dtype)


def quantize_activations(x: torch.Tensor, gk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic W8A8 activation scales: x [M, K] -> (float8 [M, K], float32 scales [M, ceil(K / gk)]),
    one per token (gk None) or per token and gk-feature group (the last one partial)."""
    m, k = x.shape
    if gk is None or gk >= k:
        scale = div_rn(x.abs().amax(dim=1, keepdim=True), FP8_MAX).clamp_(min=MIN_SCALE)
        return to_e4m3(div_rn(x, scale)), scale
    groups = cdiv(k, gk)
    padded = torch.nn.functional.pad(x.float(), (0, groups * gk - k)).view(m, groups, gk)
    scale = div_rn(padded.abs().amax(dim=2), FP8_MAX).clamp_(min=MIN_SCALE)
    q = to_e4m3(div_rn(padded, scale[:, :, None]).view(m, groups * gk)[:, :k])
    return q, scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] with a checkpoint's per-tensor activation scale (a 1-element float32 tensor)."""
    return to_e4m3(div_rn(x, input_scale))
