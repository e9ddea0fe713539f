"""Linear layers whose rows do not depend on the other rows of the step.

On CPU a GEMM (MKL, oneDNN) picks its blocking and code path by the number of rows, so a token's
product alone (one or two rows) differs bitwise from the same token's inside a larger step.
Multiplying in chunks of CHUNK_ROWS rows, the last one zero-padded, gives every call the same
shape, and a row's result does not depend on where in its chunk it sits.

On CUDA cuBLAS splits K for few rows; the product runs in kernels/invariant_matmul.py instead (no
split-K: every element summed over K in one order), which also takes the place of the GEMV and
few-row kernels (and of their fused RMSNorm / SiLU prologue: `takes_deferred` is False)."""
from collections.abc import Callable

import torch
from torch import nn

from nanoinfer.kernels.invariant_matmul import invariant_matmul
from nanoinfer.layers.linear_method import Deferred, LinearMethod

CHUNK_ROWS = 16


def fixed_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """product(x) computed CHUNK_ROWS rows at a time, every call [CHUNK_ROWS, in features]."""
    rows = x.shape[0]
    pad = -rows % CHUNK_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return torch.cat([product(chunk) for chunk in x.split(CHUNK_ROWS)])[:rows]


class InvariantLinearMethod(LinearMethod):
    """Another method's weights and loading; its product made batch-invariant. On CUDA the inner
    method must hold a dense `weight` (options.py refuses quantized weights there)."""

    def __init__(self, inner: LinearMethod):
        self.inner = inner

    def create_weights(self, layer, input_size, output_size, bias):
        self.inner.create_weights(layer, input_size, output_size, bias)

    def load_weight(self, layer, param, loaded, where):
        self.inner.load_weight(layer, param, loaded, where)

    def process_weights_after_loading(self, layer: nn.Module):
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None, out=None):
        if isinstance(x, Deferred):  # (never made: takes_deferred is False)
            x = x.materialize()
        if x.is_cuda:
            return invariant_matmul(x, layer.weight, bias, out=out)
        y = fixed_rows(lambda chunk: self.inner.apply(layer, chunk, bias), x)
        return y if out is None else out.copy_(y)

    def takes_deferred(self, layer, x):
        return False


def invariant_chooser(choose: Callable[[str], LinearMethod]) -> Callable[[str], LinearMethod]:
    """ModelBuild.linear_method: `choose`'s method for each layer, made batch-invariant."""
    return lambda prefix: InvariantLinearMethod(choose(prefix))
