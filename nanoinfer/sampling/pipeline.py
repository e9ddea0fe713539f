"""The logits pipeline: one step's logits [B, V] -> its tokens [B], all batched, on the device.

A step's pipeline is one ordered list of Stages (sampling/option.py): the edits of the options its
rows use (SamplingTensors.stages, in vLLM's order, each run only when some row uses it), then the
end that picks the tokens (sampling/draw.py). Logprobs are taken from the raw logits, before any edit.
A step whose rows use temperature alone (SamplingTensors.plain) skips the list on CUDA: a fused
Triton kernel (kernels/sampling.py) reads the logits once for temperature, noise and argmax; a token
mask is applied just before it.
"""
import torch

from nanoinfer.kernels.sampling import NON_FINITE, sample_gumbel_argmax
from nanoinfer.sampling.draw import SAMPLE
from nanoinfer.sampling.logprobs import gather_logprobs, logprobs_to_host, raw_logprobs
from nanoinfer.sampling.option import Stage
from nanoinfer.sampling.tensors import SamplingTensors

__all__ = ["sample_logits", "logprobs_to_host"]


def _stages_for(t: SamplingTensors, pipeline) -> list[Stage]:
    """The stages this step runs: those that apply, up to and including the first end that does."""
    todo = []
    for stage in pipeline:
        if stage.applies(t):
            todo.append(stage)
            if stage.end:
                return todo
    raise ValueError(f"no end of the sampling pipeline applies: {[s.name for s in pipeline]}")


def mark_non_finite_rows(logits: torch.Tensor, tokens: torch.Tensor,
                         edited: torch.Tensor | None = None) -> torch.Tensor:
    """The pipeline's tokens, NON_FINITE where the row's raw logits hold a NaN or +inf (or are all
    -inf), as the fused kernel marks them: one max per row (it propagates NaN); and, given the
    `edited` logits, where the row's constraints left no token above -inf (allowed ids, bad words
    or min_tokens that exclude everything its grammar allows; a logits processor that raised)."""
    if logits.shape[0] == 0:
        return tokens
    ok = torch.isfinite(logits.amax(dim=-1))
    if edited is not None:
        ok &= edited.amax(dim=-1) > float("-inf")
    return torch.where(ok, tokens, NON_FINITE)


@torch.inference_mode()
def sample_logits(logits: torch.Tensor, t: SamplingTensors, pipeline=None) -> tuple[torch.Tensor, tuple | None]:
    """The sampled token ids [B] on the device (an int dtype; NON_FINITE as mark_non_finite_rows
    says, the fused kernel among the tokens a row's mask allows), and the logprob tensors for
    logprobs_to_host (None when no row asked). `pipeline`: the stages (None: t.stages, then SAMPLE).
    The caller's logits are left as they were."""
    todo = _stages_for(t, pipeline or (*t.stages, SAMPLE))
    fused = logits.is_cuda and t.plain  # (its only edit, if any: a token mask, applied first)
    raw = logits
    logits = logits if fused else logits.float()
    if logits is raw and len(todo) > 1:
        logits = logits.clone()  # edited in place by the stages: leave the caller's tensor alone
    lp = raw_logprobs(logits, t)
    for stage in todo[:-1]:
        stage.run(logits, t)
    if fused:
        return sample_gumbel_argmax(logits, t.temperatures, t.seed), None
    tokens = todo[-1].run(logits, t)
    logprobs = None if lp is None else gather_logprobs(lp, tokens, t)
    edited = logits if len(todo) > 1 else None
    return mark_non_finite_rows(raw, tokens.to(torch.int64), edited), logprobs

