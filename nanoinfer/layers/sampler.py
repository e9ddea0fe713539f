"""Batched sampling on the device: temperature 0 is argmax, otherwise sample softmax(logits / T)
with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which needs no cumulative sum."""
import torch
from torch import nn


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, all_greedy: bool = False) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if all_greedy:
            return greedy
        t = temperatures.clamp_min(1e-5).unsqueeze(1)
        probs = torch.softmax(logits / t, dim=-1)
        sampled = probs.div_(torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)
