import torch
from torch import nn

from nanoinfer.kernels import norm_act
from nanoinfer.layers import linear as linear_layers
from nanoinfer.layers.all_reduce import PartialSum
from nanoinfer.layers.linear import Deferred


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The fused pre-norm step: residual += x, then normalise; returns (normed, new residual)."""
    x = x.float() + residual.float()
    residual = x.to(residual.dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(residual.dtype), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: "torch.Tensor | PartialSum", residual: torch.Tensor | None = None, defer: bool = False):
        """With a residual, adds it first and returns (normed, new residual). defer=True: for a
        single row on CUDA the norm is left to the GEMV of the linear layer the caller passes the
        result to (a Deferred; layers/linear.py), which also fills the returned residual. Only
        for callers whose next step is a linear layer. A PartialSum x (tensor parallel) is summed
        over the ranks in the same kernel as the residual add and norm."""
        if isinstance(x, PartialSum):
            return x.reduce_norm(self.weight, self.eps, residual)
        if defer and linear_layers.takes_gemv(x) and (residual is None or residual.is_contiguous()):
            if residual is None:
                return Deferred(x, self.weight, self.eps)
            out = torch.empty_like(residual)  # written by the GEMV
            return Deferred(x, self.weight, self.eps, residual, out), out
        if x.is_cuda:  # one Triton kernel (kernels/norm_act.py); these functions are its reference
            shape = x.shape
            out = norm_act.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps,
                                    None if residual is None else residual.reshape(-1, shape[-1]))
            if residual is None:
                return out.view(shape)
            return out[0].view(shape), out[1].view(shape)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
