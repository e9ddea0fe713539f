"""The one encoding of a step, built by the engine from the scheduled batch. Runners never see a
Sequence: every rank gets the StepInput; the rank that samples (rank 0) also gets the SampleInput;
it answers with a StepResult. In-process (one rank) they are passed as they are; with tensor
parallelism they are pickled to the worker processes, so they hold only plain data."""
from dataclasses import dataclass

import torch

from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.layers.sampling_tensors import SamplingPlan


@dataclass
class StepInput:
    """What every rank needs. Row: (start position, the token ids to compute, block table). A
    decode row whose input token the step still in flight sampled carries, instead of ids, the row
    of that step which sampled it: every rank reads the token from that step's device tensor."""
    rows: list[tuple[int, list[int] | int, list[int]]]
    num_decode: int                         # leading rows with one query token
    prompt_logit_rows: list[int] | None = None  # flat token rows whose logits are also computed (prompt_logprobs)
    # (temperatures, seed) when every rank samples its shard of the vocabulary (tensor parallelism
    # on CUDA, rows that use temperature alone: layers/sampler.py, sample_vocab_shard)
    plain_sample: tuple[list[float], int] | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.rows)


@dataclass
class SampleInput:
    """What the sampling rank needs besides: the sampling options, and for prompt_logprobs the
    segments (row, first position, count, top-k) and the prompt token each position predicts."""
    plan: SamplingPlan
    prompt_logprobs: tuple[list[tuple[int, int, int, int]], list[int], int] | None = None


@dataclass
class StepResult:
    """A step's outcome, on the host: a sampled token per row; per row that asked, its logprobs
    (top ids, top logprobs, sampled logprob, rank); per prompt_logprobs segment (row, first
    position, an entry (logprob, rank, top ids, top logprobs) per position)."""
    tokens: list[int]
    logprobs: list | None = None
    prompt_logprobs: list[tuple[int, int, list]] | None = None


def sampled_rows(batch: ScheduledBatch) -> dict[int, int]:
    """seq_id -> row, for the rows of a batch that sample a token."""
    return {seq.seq_id: row for row, seq in enumerate(batch.seqs) if batch.samples[row]}


def encode_step(batch: ScheduledBatch, prev_rows: dict[int, int] | None, vocab_size: int, eos_token_ids,
                seeds: torch.Generator | None = None, sample_on_shards: bool = False) -> tuple[StepInput, SampleInput]:
    """The step's messages. `prev_rows`: sampled_rows() of the step still in flight, if any.
    `seeds`: the generator plain steps draw their seed from (SamplingPlan.build). `sample_on_shards`:
    the ranks can sample their vocabulary shards (tensor parallelism on CUDA)."""
    rows = []
    for seq, start, n in zip(batch.seqs, batch.starts, batch.query_lens):
        tokens = seq.token_ids
        rows.append((start, tokens[start:start + n] if start + n <= len(tokens) else prev_rows[seq.seq_id],
                     seq.block_table))
    step = StepInput(rows, batch.num_decode)
    sample = SampleInput(SamplingPlan.build(batch.seqs, vocab_size, eos_token_ids, batch.samples, prev_rows, seeds))
    wanted = _prompt_logprob_rows(batch)
    if wanted is not None:
        segments, step.prompt_logit_rows, targets, k = wanted
        sample.prompt_logprobs = (segments, targets, k)
    elif sample_on_shards and sample.plan.plain:
        step.plain_sample = (sample.plan.temperatures, sample.plan.seed)
    return step, sample


def _prompt_logprob_rows(batch: ScheduledBatch):
    """The prompt positions whose logits a step must compute for prompt_logprobs (a request's first
    sample computes them): (segments (row, first position, count, top-k), flat token rows, the
    prompt token each position predicts, the largest top-k), or None (the common case)."""
    segments, rows, targets, k = [], [], [], 0
    offset = batch.num_decode  # decode rows have one query token each and no prompt positions
    for r in range(batch.num_decode, len(batch.seqs)):
        seq, start, q = batch.seqs[r], batch.starts[r], batch.query_lens[r]
        n = seq.sampling_params.prompt_logprobs
        end = min(start + q, seq.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
        if n is not None and seq.index == 0 and start < end:
            segments.append((r, start, end - start, n))
            rows.extend(range(offset, offset + end - start))
            targets.extend(seq.token_ids[start + 1:end + 1])
            k = max(k, n)
        offset += q
    return (segments, rows, targets, k) if segments else None
