"""How a linear layer holds, loads and multiplies its weights: the seam weight formats plug into
(vLLM's LinearMethodBase; docs/architecture.md). Dense products go through `linear`, which takes
the GEMV or the few-row GEMM where they beat cuBLAS; those kernels can also apply the RMSNorm or
SiLU * mul before them (a `Deferred` input)."""
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels.gemv import gemv
from nanoinfer.kernels.skinny_gemm import skinny_gemm
from nanoinfer.layers.layernorm import add_rms_norm, rms_norm
from nanoinfer.utils.loader import check_shape

# few_row_kernel's limits (rows, weight bytes): the GEMV's, then the few-row GEMM's
GEMV_ROWS, GEMV_WEIGHT_BYTES = 2, 16 << 20
FEW_ROWS, FEW_ROWS_WEIGHT_BYTES = 16, 32 << 20


def takes_gemv(x: torch.Tensor) -> bool:
    """One contiguous row on CUDA (decode at batch 1), where kernels/gemv.py beats cuBLAS."""
    return x.is_cuda and x.shape[0] == 1 and x.is_contiguous()


def few_row_kernel(x: torch.Tensor, weight: torch.Tensor):
    """The kernel for 2-FEW_ROWS rows of 16-bit values on CUDA against `weight`, or None for
    cuBLAS. At a few rows cuBLAS reads a small weight far below copy speed (split-K plus a reduce
    kernel; nanoinfer.bench.skinny_gemm measures it); on larger weights it streams faster."""
    if not (x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= FEW_ROWS and x.stride(-1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.is_contiguous()):
        return None
    nbytes = weight.numel() * weight.element_size()
    if x.shape[0] <= GEMV_ROWS and nbytes <= GEMV_WEIGHT_BYTES:
        return gemv
    return skinny_gemm if nbytes <= FEW_ROWS_WEIGHT_BYTES else None


def product_kernel(x: torch.Tensor, weight: torch.Tensor):
    """The GEMV or few-row GEMM that multiplies x by `weight` faster than cuBLAS, or None."""
    return gemv if takes_gemv(x) and weight.is_contiguous() else few_row_kernel(x, weight)


def fuses_prologue(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` would apply a Deferred step of input x itself."""
    return product_kernel(x, weight) is not None


@dataclass
class Deferred:
    """A linear layer's input whose last elementwise step, RMSNorm (with the residual add) or
    SiLU * mul, is left to the layer's product, which applies it while loading: one kernel fewer
    at small batch. Made only for a layer that `takes_deferred` this input. For silu_mul, `x` is
    [rows, 2K] (gate, up); with a residual, the product stores x + residual into `residual_out`,
    which the norm has already returned as the new residual."""
    x: torch.Tensor
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None
    silu_mul: bool = False

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def materialize(self) -> torch.Tensor:
        """The pending step run on its own, storing the new residual as the fused kernels do."""
        if self.silu_mul:
            gate, up = self.x.chunk(2, -1)
            return F.silu(gate) * up
        if self.residual is None:
            return rms_norm(self.x, self.norm_weight, self.eps)
        normed, new_residual = add_rms_norm(self.x, self.residual, self.norm_weight, self.eps)
        self.residual_out.copy_(new_residual)
        return normed


def linear(x: "torch.Tensor | Deferred", weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), through `product_kernel` where it applies. `out` (no bias): a [rows,
    out features] tensor with contiguous rows to write the product into, which is returned."""
    if isinstance(x, Deferred):
        kernel = product_kernel(x.x, weight)
        if kernel is not None:
            return kernel(x.x, weight, bias, norm_weight=x.norm_weight, eps=x.eps, residual=x.residual,
                          residual_out=x.residual_out, silu_mul=x.silu_mul, out=out)
        x = x.materialize()
    kernel = product_kernel(x, weight)
    if kernel is not None:
        return kernel(x, weight, bias, out=out)
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
    """How one linear layer's weights are created, loaded and applied."""

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

    def takes_deferred(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply` would take a Deferred of input x and fuse its step. Default: no."""
        return False


class DenseLinearMethod(LinearMethod):
    """Unquantized weights, [output_size, input_size] in the model's dtype."""

    def create_weights(self, layer, input_size, output_size, bias):
        layer.weight = linear_parameter(torch.empty(output_size, input_size), 0, 1)
        layer.register_parameter("bias", linear_parameter(torch.empty(output_size), 0, None) if bias else None)

    def apply(self, layer, x, bias=None, out=None):
        return linear(x, layer.weight, bias, out)

    def takes_deferred(self, layer, x):
        return fuses_prologue(x, layer.weight)


_DENSE = DenseLinearMethod()


def dense_linear_method(prefix: str) -> LinearMethod:
    """The default choice: every linear layer dense."""
    return _DENSE
