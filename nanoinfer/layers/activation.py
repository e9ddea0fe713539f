import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels import norm_act
from nanoinfer.layers.linear_method import Deferred


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a merged gate_up projection output [..., 2 * intermediate]."""

    def forward(self, x: torch.Tensor, defer_to=None) -> "torch.Tensor | Deferred":
        """defer_to: the linear layer the result feeds, which may apply it itself (`takes_deferred`)."""
        if defer_to is not None and defer_to.takes_deferred(x):
            return Deferred(x, silu_mul=True)
        if x.is_cuda:  # one Triton kernel (kernels/norm_act.py); silu_and_mul is its reference
            return norm_act.silu_and_mul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
        return silu_and_mul(x)
