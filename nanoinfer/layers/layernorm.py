"""RMSNorm: one Triton kernel on CUDA (kernels/norm_act.py), whose reference and CPU path are `rms_norm`
and `add_rms_norm`. Fusing it into its neighbours is layers/fused_norm.py's job."""
import torch
from torch import nn

from nanoinfer.kernels import norm_act


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * norm(x) over the last dimension."""
        if x.is_cuda:
            return norm_act.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x, then normalise: returns (normed, new residual)."""
        if x.is_cuda:
            width = x.shape[-1]
            out, res = norm_act.rms_norm(x.reshape(-1, width), self.weight, self.eps, residual.reshape(-1, width))
            return out.view(x.shape), res.view(x.shape)
        return add_rms_norm(x, residual, self.weight, self.eps)
