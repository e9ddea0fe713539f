"""Sampling for one rank: the one entry point from a step's logits to its tokens.

`prepare` turns the step's SamplingPlan into device tensors before the forward (their copies
overlap it); `sample` takes the logits of this rank's vocabulary shard and returns the step's
tokens on every rank's device:
- a step at temperature alone with tensor parallelism on CUDA (StepInput.plain_sample): every rank
  samples its shard and the ranks agree on the winners (sample_vocab_shard);
- otherwise rank 0 gathers the full rows, computes prompt logprobs, runs the logits pipeline
  (sampling/pipeline.py) and, with tensor parallelism, broadcasts the tokens.
`to_host` brings a step's logprobs to the host once its tokens are there.
A row whose logits are not finite gets the token NON_FINITE (-1): the engine fails its request.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoinfer.step.step_message import (PromptLogprobs, PromptLogprobsRequest, SampleInput, StepInput,
                                           TokenLogprobs)
from nanoinfer.kernels.sampling import gumbel_argmax_partials, pick_token
from nanoinfer.sampling.column_cache import ColumnCache
from nanoinfer.sampling.constraint_store import TokenConstraintStore
from nanoinfer.sampling.pipeline import logprobs_to_host, sample_logits
from nanoinfer.sampling.tensors import SamplingTensors
from nanoinfer.utils.device_copy import to_device

PROMPT_LOGPROBS_SLICE = 1024  # rows per log-softmax: the float32 copy stays small for long prompts


class SamplingFailed(Exception):
    """Sampling raised on rank 0 after the forward; the other ranks were kept in step."""


@dataclass(slots=True)
class Sampled:
    """A step's sampling output on the device: the tokens, and when asked the logprob tensors of
    the sampled rows and of the prompt positions."""
    tokens: torch.Tensor               # [rows] int64
    args: SamplingTensors | None = None
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None   # (request, token logprob, rank, top ids, top logprobs)


def sample_vocab_shard(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col0: int) -> torch.Tensor:
    """Tensor parallelism on CUDA, a step whose rows use temperature alone (SamplingPlan.plain):
    each rank samples its shard of the vocabulary (`logits`, columns from col0), the ranks
    all-gather their rows' per-chunk winners (a few bytes a row instead of the logits), and every
    rank picks the same tokens: those the fused kernel takes on the full rows with this seed.
    Returns them [B] int64, on every rank."""
    parts = gumbel_argmax_partials(logits, temperatures, seed, col0)
    everyone = parts.new_empty((dist.get_world_size(), *parts.shape))
    dist.all_gather_into_tensor(everyone, parts)
    return pick_token(everyone)


class Sampler:
    def __init__(self, lm_head, rank: int, world_size: int, device: torch.device):
        self.lm_head = lm_head  # gathers the logits' vocabulary shards; knows this rank's first column
        self.rank, self.world_size, self.device = rank, world_size, device
        self.columns = ColumnCache(device)  # the last step's per-row option tensors
        self.constraints = TokenConstraintStore(device)  # the requests' token constraints, by key

    def prepare(self, sample: SampleInput | None, prev_tokens: torch.Tensor | None) -> SamplingTensors | None:
        """The plan's device tensors (rank 0); prev_tokens: the step in flight's, which the plan's
        late penalty entries read."""
        if sample is None:
            return None
        return SamplingTensors.from_plan(sample.plan, self.device, prev_tokens, self.columns, self.constraints)

    def fused_in_graph(self, step: StepInput, sample: SampleInput | None, args: SamplingTensors | None) -> bool:
        """Whether this step may sample inside the decode graphs (engine/graph_runner.py
        sample_decode): one rank, a decode-only step (a token a row, each row sampling), every row
        at temperature alone with the fused kernel (sample_logits' CUDA path), no grammar."""
        return (self.world_size == 1 and step.is_decode_only and args is not None and args.plain
                and args.grammar_rows is None and self.device.type == "cuda" and step.sample_rows is None
                and not step.prompt_logit_rows and sample.prompt_logprobs is None)

    def sample(self, step: StepInput, sample: SampleInput | None, args: SamplingTensors | None,
               logits: torch.Tensor) -> Sampled:
        """The step's tokens on every rank. `logits`: this rank's shard, the step's rows first,
        then its prompt_logit_rows."""
        if step.plain_sample is not None:
            plain = step.plain_sample
            temps = args.temperatures if args is not None else \
                self.columns.get("temperatures", plain.temperatures, torch.float32)
            return Sampled(sample_vocab_shard(logits, temps, plain.seed, self.lm_head.vocab_start), args)
        rows = step.num_sample_rows
        if sample is None:  # a rank that does not sample: its shard goes to rank 0, the tokens come back
            self.lm_head.gather(logits)
            tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
            dist.broadcast(tokens, 0)
            return Sampled(tokens)
        logits = self.lm_head.gather(logits)  # the full rows
        prompt = None
        if sample.prompt_logprobs is not None:
            prompt = self._prompt_logprobs(logits[rows:], sample.prompt_logprobs)
            logits = logits[:rows]
        try:
            tokens, logprobs = sample_logits(logits, args)
        except Exception as e:  # e.g. a user's logits processor
            if self.world_size == 1:
                raise
            dist.broadcast(torch.zeros(rows, dtype=torch.int64, device=self.device), 0)  # the others wait
            raise SamplingFailed(f"{type(e).__name__}: {e}") from e
        tokens = tokens.to(torch.int64)  # (NON_FINITE rows marked by the pipeline)
        if self.world_size > 1:
            dist.broadcast(tokens, 0)
        return Sampled(tokens, args, logprobs, prompt)

    def _prompt_logprobs(self, logits: torch.Tensor, request: PromptLogprobsRequest) -> tuple:
        """Raw log-softmax of the prompt positions' logits: the next prompt token's logprob and
        rank, and the top-k."""
        targets = to_device(request.targets, torch.int64, self.device)
        parts = []
        for lo in range(0, logits.shape[0], PROMPT_LOGPROBS_SLICE):
            hi = lo + PROMPT_LOGPROBS_SLICE
            lp = torch.log_softmax(logits[lo:hi].float(), dim=-1)
            tok = lp.gather(1, targets[lo:hi, None])
            top = lp.topk(min(request.top_k, lp.shape[1]), dim=-1)
            parts.append((tok[:, 0], (lp > tok).sum(dim=-1) + 1, top.indices, top.values))
        return request, *(torch.cat(x) for x in zip(*parts))

    @staticmethod
    def to_host(sampled: Sampled, rows: int) -> tuple[list | None, list[PromptLogprobs] | None]:
        """(per-row TokenLogprobs or None, per-segment PromptLogprobs or None), once the step's
        tokens have reached the host."""
        logprobs = prompt_logprobs = None
        if sampled.logprobs is not None:
            logprobs = logprobs_to_host(sampled.args, rows, sampled.logprobs)
        if sampled.prompt_logprobs is not None:
            request, *tensors = sampled.prompt_logprobs
            tok_lp, rank, top_ids, top_lp = (x.tolist() for x in tensors)
            prompt_logprobs, i = [], 0
            for s in request.segments:
                entries = [TokenLogprobs(top_ids[j][:s.top_k], top_lp[j][:s.top_k], tok_lp[j], rank[j])
                           for j in range(i, i + s.count)]
                prompt_logprobs.append(PromptLogprobs(s.row, s.start, entries))
                i += s.count
        return logprobs, prompt_logprobs
