"""The pre-norm step of a decoder block, "residual += hidden, normalise, for `consumer`" (the next
linear layer, or a block starting with one), fused where it can be: with the tensor-parallel
all-reduce before it (hidden a PartialSum: kernels/all_reduce_norm.py), or into the consumer's
product (a Deferred, where the consumer `takes_deferred` the input)."""
import torch

from nanoinfer.layers.all_reduce import PartialSum
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear_method import Deferred


def add_norm_for(norm: RMSNorm, hidden: "torch.Tensor | PartialSum", residual: torch.Tensor | None,
                 consumer=None) -> "tuple[torch.Tensor | Deferred, torch.Tensor]":
    """Returns (the normed input for `consumer`, the new residual). residual None (the first
    layer): hidden is the residual. consumer: anything with `takes_deferred(x)`, or None (the
    result is read as a tensor)."""
    if isinstance(hidden, PartialSum):
        if residual is None:  # (the sum, which would be the residual, never leaves the kernel)
            raise ValueError("add_norm_for: a PartialSum needs a residual")
        return hidden.reduce_norm(norm.weight, norm.eps, residual)
    if consumer is not None and (residual is None or residual.is_contiguous()) and consumer.takes_deferred(hidden):
        if residual is None:
            return Deferred(hidden, norm.weight, norm.eps), hidden
        out = torch.empty_like(residual)  # written by the consumer's kernel
        return Deferred(hidden, norm.weight, norm.eps, residual, out), out
    if residual is None:
        return norm(hidden), hidden
    return norm.add_and_norm(hidden, residual)
