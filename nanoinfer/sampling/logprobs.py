"""Sample logprobs, as vLLM reports them: the log-softmax of the model's raw logits, before any
pipeline stage edits them, for the rows that asked: each row's own top N, and the sampled token's
logprob and rank. They stay on the device until the step's tokens are copied to the host.
"""
import torch

from nanoinfer.step.step_message import TokenLogprobs
from nanoinfer.sampling.tensors import SamplingTensors


def raw_logprobs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor | None:
    """[R, V] log-softmax of the rows that asked (None when none did); taken before the stages run."""
    if t.lp_max is None:
        return None
    return torch.log_softmax(logits if t.lp_rows is None else logits[t.lp_rows], dim=-1)


def gather_logprobs(lp: torch.Tensor, tokens: torch.Tensor, t: SamplingTensors) -> tuple:
    """(top ids [R, lp_max], top logprobs, sampled token's logprob [R], its rank [R]), on the device."""
    sampled = tokens if t.lp_rows is None else tokens[t.lp_rows]
    sampled_lp = lp.gather(1, sampled[:, None])
    rank = (lp > sampled_lp).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(t.lp_max, dim=-1)
    return top_ids, top_lp, sampled_lp[:, 0], rank


def logprobs_to_host(t: SamplingTensors, batch: int, lp) -> list[TokenLogprobs | None]:
    """sample_logits' logprob tensors as one TokenLogprobs per row, None for rows that did not ask."""
    top_ids, top_lp, sampled_lp, rank = (x.tolist() for x in lp)
    out = [None] * batch
    for j, (row, n) in enumerate(zip(t.lp_rows_list, t.lp_counts)):
        out[row] = TokenLogprobs(top_ids[j][:n], top_lp[j][:n], sampled_lp[j], rank[j])
    return out
