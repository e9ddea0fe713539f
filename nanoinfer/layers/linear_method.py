"""How a linear layer holds, loads and multiplies its weights: the seam weight formats plug into
(vLLM's LinearMethodBase). A layer (layers/linear.py) owns its shape and its tensor-parallel cut; its
method, chosen per layer by the model's build (layers/model_build.py), creates the parameters, copies
each checkpoint tensor's share into them, and computes the product. Dense weights are
`DenseLinearMethod`; a quantized format creates its own parameters (e.g. weight + scales) and applies
its own product; an adapter method wraps another method's `apply`.

Dense products go through `linear`: one-row inputs on CUDA take the GEMV kernel (kernels/gemv.py),
which can also apply the RMSNorm or SiLU * mul before it (a `Deferred` input); a few rows against
a narrow, deep weight take the few-row GEMM (kernels/skinny_gemm.py)."""
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels.gemv import gemv
from nanoinfer.kernels.skinny_gemm import skinny_gemm
from nanoinfer.utils.loader import check_shape


def takes_gemv(x: torch.Tensor) -> bool:
    """One contiguous row on CUDA (decode at batch 1): dense products use kernels/gemv.py, faster
    than cuBLAS there, which can also fuse the elementwise step before them (Deferred)."""
    return x.is_cuda and x.shape[0] == 1 and x.is_contiguous()


def takes_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """2-16 rows of 16-bit values on CUDA against a weight of at most 1024 output features and at
    least 2048 input features (an o_proj or down_proj of a small model): there cuBLAS splits K and
    adds a reduce kernel, and kernels/skinny_gemm.py, one kernel, was faster on the H200
    (nanoinfer.bench.skinny_gemm). On larger weights cuBLAS streams faster."""
    return (x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= 16 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] <= 1024 and weight.shape[1] >= 2048 and x.stride(-1) == 1
            and weight.is_contiguous())


@dataclass
class Deferred:
    """A linear layer's input whose last elementwise step, RMSNorm (with the residual add) or
    SiLU * mul, is left to the layer's GEMV, which applies it while loading: one kernel fewer per
    use at batch 1. Made for takes_gemv inputs only (layers/fused_norm.py, SiluAndMul(defer=True)),
    for a layer whose method `accepts_deferred`. For silu_mul, `x` is [1, 2K] (gate, up); with a
    residual, the GEMV stores x + residual into `residual_out`, which the norm has already returned
    as the new residual."""
    x: torch.Tensor
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    silu_mul: bool = False

    @property
    def rows(self) -> int:
        return self.x.shape[0]


def linear(x: "torch.Tensor | Deferred", weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias): the GEMV kernel for one row on CUDA, the few-row GEMM where it is
    faster than cuBLAS, else F.linear. `out` (no bias):
    a contiguous [rows, out features] tensor to write the product into, which is returned."""
    if isinstance(x, Deferred):
        return gemv(x.x, weight, bias, norm_weight=x.norm_weight, eps=x.eps, residual=x.residual,
                    residual_out=x.residual_out, silu_mul=x.silu_mul, out=out)
    if takes_gemv(x) and weight.is_contiguous():
        return gemv(x, weight, bias, out=out)
    if takes_skinny_gemm(x, weight):
        return skinny_gemm(x, weight, bias, out=out)
    if out is not None:
        if bias is not None:
            raise ValueError("linear: out= takes no bias")
        return torch.mm(x, weight.t(), out=out)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class ShardSlice:
    """Where one checkpoint tensor goes in a layer's parameters, in features (a weight's rows are
    output features, its columns input features): the tensor has `out_full` output and `in_full`
    input features; output features [out_start, out_start + out_size) of it go to this rank's
    [out_offset, out_offset + out_size), input features [in_start, in_start + in_size) to all of
    this rank's. `shard_id`: which part of a fused layer it is (None: the whole layer)."""
    out_full: int
    out_start: int
    out_size: int
    out_offset: int
    in_full: int
    in_start: int
    in_size: int
    shard_id: Hashable = None


def linear_parameter(data: torch.Tensor, output_dim: int | None, input_dim: int | None) -> nn.Parameter:
    """A frozen parameter that says which of its dimensions index output and input features (what
    `load_feature_slice` cuts along)."""
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    return param


def load_feature_slice(param: nn.Parameter, loaded: torch.Tensor, where: ShardSlice):
    """Check the whole checkpoint tensor's shape (narrow would silently cut a larger one, copy_
    broadcast a smaller one), then copy this rank's share of it into `param`, one element per
    feature along param.output_dim and param.input_dim."""
    expected = list(param.shape)
    if param.output_dim is not None:
        expected[param.output_dim] = where.out_full
    if param.input_dim is not None:
        expected[param.input_dim] = where.in_full
    check_shape(loaded, expected)
    target = param.data
    if param.output_dim is not None:
        loaded = loaded.narrow(param.output_dim, where.out_start, where.out_size)
        target = target.narrow(param.output_dim, where.out_offset, where.out_size)
    if param.input_dim is not None:
        loaded = loaded.narrow(param.input_dim, where.in_start, where.in_size)
    target.copy_(loaded)


class LinearMethod:
    """How one linear layer's weights are created, loaded and applied. `accepts_deferred`: whether
    `apply` takes a Deferred input (a GEMV that fuses the step before it)."""
    accepts_deferred = False

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        """Register the layer's parameters for its shard, [output_size, input_size] features (this
        rank's), each made by `linear_parameter` or given its own `weight_loader`."""
        raise NotImplementedError

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, where: ShardSlice):
        """Copy this rank's share of checkpoint tensor `loaded` into `param`."""
        load_feature_slice(param, loaded, where)

    def process_weights_after_loading(self, layer: nn.Module):
        """Called once every tensor is loaded (e.g. to repack or dequantize)."""

    def apply(self, layer: nn.Module, x: "torch.Tensor | Deferred", bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias); `out` as in `linear`."""
        raise NotImplementedError


class DenseLinearMethod(LinearMethod):
    """Unquantized weights, [output_size, input_size] in the model's dtype."""
    accepts_deferred = True

    def create_weights(self, layer, input_size, output_size, bias):
        layer.weight = linear_parameter(torch.empty(output_size, input_size), 0, 1)
        layer.register_parameter("bias", linear_parameter(torch.empty(output_size), 0, None) if bias else None)

    def apply(self, layer, x, bias=None, out=None):
        return linear(x, layer.weight, bias, out)


_DENSE = DenseLinearMethod()


def dense_linear_method(prefix: str) -> LinearMethod:
    """The default choice: every linear layer dense."""
    return _DENSE
