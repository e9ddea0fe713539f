"""A step's prompt logprobs, on both sides of the step message.

Host: `prompt_logprobs_request` reads the prompt positions a step computes logprobs for off its
batch (a request's first sample computes them; position p predicts prompt token p + 1), and
`prompt_logit_rows` the flat token rows whose logits the step computes for them.
Device (the sampling rank): `prompt_logprobs` is the raw log-softmax of those rows' logits, sliced
so that the float32 copy stays small for long prompts; `to_host` turns its tensors into each
segment's PromptLogprobs."""
from dataclasses import dataclass

import torch

from nanoinfer.step.step_message import TokenLogprobs
from nanoinfer.utils.device_copy import to_device

PROMPT_LOGPROBS_SLICE = 1024  # rows per log-softmax: the float32 copy stays small for long prompts


@dataclass(slots=True)
class PromptSegment:
    """A prefill row's prompt positions whose logprobs the step computes: `count` positions from
    `start`, each with its `top_k` most likely tokens."""
    row: int
    start: int
    count: int
    top_k: int


@dataclass(slots=True)
class PromptLogprobsRequest:
    """The step's prompt_logprobs work (SampleInput.extra_logits): its segments, the prompt token
    each position predicts (flat, in segment order), and the largest top-k."""
    segments: list[PromptSegment]
    targets: list[int]
    top_k: int


@dataclass(slots=True)
class PromptLogprobs:
    """A segment's results: entries[i] is from position start + i, for prompt token start + i + 1."""
    row: int
    start: int
    entries: list[TokenLogprobs]


def prompt_logprobs_request(batch) -> PromptLogprobsRequest | None:
    """The prompt positions a step computes logprobs for, or None (the common case)."""
    segments, targets = [], []
    for r in range(batch.num_decode, len(batch.seqs)):  # decode rows have no prompt positions
        seq, start = batch.seqs[r], batch.starts[r]
        k = seq.sampling_params.prompt_logprobs
        end = min(start + batch.query_lens[r], seq.num_prompt_tokens - 1)
        if k is not None and seq.index == 0 and start < end:
            segments.append(PromptSegment(r, start, end - start, k))
            targets += seq.token_ids[start + 1:end + 1]
    if not segments:
        return None
    return PromptLogprobsRequest(segments, targets, max(s.top_k for s in segments))


def prompt_logit_rows(batch, request: PromptLogprobsRequest) -> list[int]:
    """The flat token rows of the request's positions, in segment order (a segment starts at its
    row's first query token)."""
    first = [0]
    for q in batch.query_lens:
        first.append(first[-1] + q)
    return [i for s in request.segments for i in range(first[s.row], first[s.row] + s.count)]


def prompt_logprobs(logits: torch.Tensor, request: PromptLogprobsRequest) -> list[torch.Tensor]:
    """Raw log-softmax of the prompt positions' logits (full rows): the next prompt token's logprob
    and rank, and the top-k ids and logprobs."""
    targets = to_device(request.targets, torch.int64, logits.device)
    parts = []
    for lo in range(0, logits.shape[0], PROMPT_LOGPROBS_SLICE):
        hi = lo + PROMPT_LOGPROBS_SLICE
        lp = torch.log_softmax(logits[lo:hi].float(), dim=-1)
        tok = lp.gather(1, targets[lo:hi, None])
        top = lp.topk(min(request.top_k, lp.shape[1]), dim=-1)
        parts.append((tok[:, 0], (lp > tok).sum(dim=-1) + 1, top.indices, top.values))
    return [torch.cat(x) for x in zip(*parts)]


def to_host(request: PromptLogprobsRequest, tensors: list[torch.Tensor]) -> list[PromptLogprobs]:
    """Each segment's PromptLogprobs, from prompt_logprobs' tensors (on the host)."""
    tok_lp, rank, top_ids, top_lp = (x.tolist() for x in tensors)
    out, i = [], 0
    for s in request.segments:
        entries = [TokenLogprobs(top_ids[j][:s.top_k], top_lp[j][:s.top_k], tok_lp[j], rank[j])
                   for j in range(i, i + s.count)]
        out.append(PromptLogprobs(s.row, s.start, entries))
        i += s.count
    return out
