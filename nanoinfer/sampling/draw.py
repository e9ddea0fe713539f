"""The pipeline's sampling end: the tokens from the edited logits.

Greedy rows take the argmax. Sampled rows: logits / temperature, then the filters in vLLM's order
(min_p, top_k, top_p on what is left), then a Gumbel-max draw: argmax(x - log E), E ~ Exp(1), a
sample of softmax(x) that needs no normalisation and no cumulative sum. Seeded rows draw E from
their hashed noise (sampling/noise.py), the others from torch's generator.
"""
import torch

from nanoinfer.sampling.noise import hashed_exponential
from nanoinfer.sampling.plan import TOP_K_OFF
from nanoinfer.sampling.option import Stage
from nanoinfer.sampling.tensors import SamplingTensors
from nanoinfer.sampling_params import SAMPLING_EPS


def apply_top_k_top_p(x: torch.Tensor, t: SamplingTensors) -> None:
    """With top_p: sort once, top_k then top_p in sorted order. top_k alone: the k-th largest value
    is the threshold (ties kept), without a full sort for small k."""
    neg_inf = float("-inf")
    if t.top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        pos = torch.arange(x.shape[1], device=x.device)[None, :]
        if t.top_k is not None:
            sorted_x.masked_fill_(pos >= t.top_k[:, None], neg_inf)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= t.top_p[:, None]) & (t.top_p[:, None] < 1.0) & (pos > 0)
        sorted_x.masked_fill_(drop, neg_inf)
        x.scatter_(1, order, sorted_x)  # order is a permutation of each row: every entry rewritten
        return
    if t.max_top_k <= 1024:
        top = x.topk(t.max_top_k, dim=-1).values
    else:
        top = x.sort(dim=-1, descending=True).values
    kth = top.gather(1, (t.top_k.clamp(max=top.shape[1]) - 1)[:, None])
    kth = torch.where(t.top_k[:, None] >= TOP_K_OFF, neg_inf, kth)
    x.masked_fill_(x < kth, neg_inf)


def filtered_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """A new [B, V] tensor: logits / temperature (greedy rows at 1), then the filters the rows use,
    in vLLM's order (-inf = dropped)."""
    temps = torch.where(t.temperatures < SAMPLING_EPS, 1.0, t.temperatures)
    x = logits / temps[:, None]
    if t.min_p is not None:  # p < min_p * p_max  <=>  x < x_max + log(min_p)
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + torch.log(t.min_p)[:, None], float("-inf"))
    if t.top_k is not None or t.top_p is not None:
        apply_top_k_top_p(x, t)
    return x


def draw(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    greedy = logits.argmax(dim=-1) if t.any_greedy else None
    if t.all_greedy:
        return greedy
    x = filtered_logits(logits, t)
    noise = torch.empty_like(x).exponential_()
    if t.seeded_rows is not None:
        noise[t.seeded_rows] = hashed_exponential(t.seed_keys, x.shape[1])
    tokens = x.sub_(noise.clamp_min_(1e-10).log_()).argmax(dim=-1)  # the Gumbel-max draw: argmax(x - log E)
    return tokens if greedy is None else torch.where(t.temperatures == 0, greedy, tokens)


SAMPLE = Stage("sample", lambda t: True, draw, end=True)
