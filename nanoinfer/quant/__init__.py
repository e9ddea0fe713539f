"""Quantized weight formats, plugged into the linear-layer weight seam (layers/linear_method.py).
FP8 only: block FP8 (Qwen3-FP8, DeepSeek), compressed-tensors FP8 (RedHatAI), per-tensor FP8, and
online per-channel FP8 of a high-precision checkpoint (quantization="fp8"). fp8_scheme.py reads the
format, fp8_linear.py is the linear method, fp8_math.py the torch arithmetic; the kernels are
kernels/fp8_gemv.py (one row), fp8_skinny_gemm.py (W8A16, a few rows), fp8_quant.py (activation
scales) and fp8_gemm.py (W8A8, more rows); MoE experts load FP8 in layers/fused_moe.py and run
weight-only FP8 in kernels/fused_moe.py."""
from collections.abc import Callable

from nanoinfer.layers.linear_method import LinearMethod, dense_linear_method
from nanoinfer.quant.fp8_linear import Fp8LinearMethod
from nanoinfer.quant.fp8_scheme import Fp8Scheme, fp8_scheme

__all__ = ["Fp8Scheme", "fp8_scheme", "linear_method_chooser", "is_router"]


def is_router(prefix: str) -> bool:
    """An MoE router (mlp.gate): always dense, as vLLM builds it (quant_config=None)."""
    return prefix.endswith(".mlp.gate") or prefix.endswith(".block_sparse_moe.gate")


def checkpoint_names(prefix: str, packed: dict) -> list[str]:
    """The checkpoint module names behind our module `prefix`: a fused layer (qkv_proj) stands for
    its shards (q_proj, k_proj, v_proj) under a model's packed_modules_mapping."""
    head, _, last = prefix.rpartition(".")
    parts = [ckpt for ckpt, (ours, _) in packed.items() if ours == last]
    return [f"{head}.{p}" if head else p for p in parts] or [prefix]


def linear_method_chooser(scheme: Fp8Scheme | None, packed: dict) -> Callable[[str], LinearMethod]:
    """ModelBuild.linear_method for `scheme`: FP8 for every linear layer except routers and the ones
    the checkpoint leaves dense; a fused layer whose shards disagree is refused."""
    if scheme is None:
        return dense_linear_method
    method = Fp8LinearMethod(scheme)

    def choose(prefix: str) -> LinearMethod:
        if is_router(prefix):
            return dense_linear_method(prefix)
        names = checkpoint_names(prefix, packed)
        ignored = [scheme.is_ignored(n) for n in names]
        if all(ignored):
            return dense_linear_method(prefix)
        if any(ignored):
            raise ValueError(f"quantization_config leaves {[n for n, i in zip(names, ignored) if i]} unquantized "
                             f"but not {[n for n, i in zip(names, ignored) if not i]}: fused layer {prefix!r} "
                             "must be one format")
        return method

    return choose
