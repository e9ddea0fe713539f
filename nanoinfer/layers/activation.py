import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels import norm_act
from nanoinfer.layers import linear_method
from nanoinfer.layers.linear_method import Deferred


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a merged gate_up projection output [..., 2 * intermediate]."""

    def forward(self, x: torch.Tensor, defer: bool = False) -> "torch.Tensor | Deferred":
        """defer=True (the caller feeds a linear layer that accepts_deferred): a single row on CUDA
        is left to that layer's GEMV."""
        if defer and linear_method.takes_gemv(x):
            return Deferred(x, silu_mul=True)
        if x.is_cuda:  # one Triton kernel (kernels/norm_act.py); silu_and_mul is its reference
            return norm_act.silu_and_mul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
        return silu_and_mul(x)
