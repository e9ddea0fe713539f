"""Scheduled sequences -> the step message (step/step_message.py): the one place a step's rows and
sampling plan are read off Sequences, and where the features add their parts (EngineFeature.encode)."""
import random

from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.step.row_planner import RowPlanner
from nanoinfer.step.step_message import SampleInput, StepInput
from nanoinfer.sampling.plan import build_sampling_plan
from nanoinfer.sampling.sampler import vocab_shard_sample


def sampled_rows(batch: ScheduledBatch) -> dict[int, int]:
    """seq_id -> row of the step's tokens, for the rows of a batch that sample a token (a row of
    several tokens has a token per query position: its last one is named)."""
    if not batch.drafts:  # (the common case, per step: a comprehension)
        return {seq.seq_id: row for row, seq in enumerate(batch.seqs) if batch.samples[row]}
    rows, i = {}, -1
    for row, seq in enumerate(batch.seqs):
        i += 1 + len(batch.drafts.get(row) or ())
        if batch.samples[row]:
            rows[seq.seq_id] = i
    return rows


class StepEncoder:
    """seeds: the generator plain steps draw their noise seed from. sample_on_shards: the ranks can
    sample their vocabulary shards (tensor parallelism on CUDA). masks_later, sampling_options: as
    build_sampling_plan's. rows: the planner that expands rows of several tokens into sampling rows."""

    def __init__(self, vocab_size: int, eos_token_ids, seeds: random.Random | None = None,
                 sample_on_shards: bool = False, features=(), masks_later: bool = False,
                 rows: RowPlanner | None = None, sampling_options=()):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.seeds = seeds
        self.sample_on_shards = sample_on_shards
        self.features = features
        self.masks_later = masks_later
        self.rows = rows or RowPlanner()
        self.awaits: dict = {}  # the last step's: feature -> its state to complete before the step samples
        self.encoded: list = []  # the features that added their parts to the last step
        self.sampling_options = sampling_options

    def unschedule(self):
        """The step last encoded was not launched."""
        for feature in self.encoded:
            feature.unschedule()
        self.encoded = []
        for option in self.sampling_options:
            option.unschedule()

    def encode(self, batch: ScheduledBatch, prev_rows: dict[int, int] | None) -> tuple[StepInput, SampleInput]:
        """The step's messages. `prev_rows`: sampled_rows() of the step still in flight, if any."""
        self.encoded, self.awaits = [], {}
        step = encode_rows(batch, prev_rows)
        seqs, samples = batch.seqs, batch.samples
        if batch.drafts:  # rows of several tokens: one sampling row per query position
            seqs, samples, step.sample_rows = self.rows.sampling_rows(batch)
        plan = build_sampling_plan(seqs, self.vocab_size, self.eos_token_ids, samples, prev_rows, self.seeds,
                                   self.masks_later, self.sampling_options)
        sample = SampleInput(plan)
        for feature in self.features:
            self.encoded.append(feature)
            state = feature.encode(batch, step, sample, seqs)
            if state is not None:
                self.awaits[feature] = state
        step.plain_sample = vocab_shard_sample(sample, self.sample_on_shards)
        return step, sample


def encode_rows(batch: ScheduledBatch, prev_rows: dict[int, int] | None) -> StepInput:
    """Every row's query tokens, flat; a decode row whose token is still in flight reads it from
    the previous step's row that sampled it."""
    seqs, starts = batch.seqs[:batch.num_decode], batch.starts
    on_host = [start < len(seq.token_ids) for seq, start in zip(seqs, starts)]
    input_ids = [seq.token_ids[start] if here else 0 for seq, start, here in zip(seqs, starts, on_host)]
    inflight_rows = [row for row, here in enumerate(on_host) if not here]
    inflight_sources = [prev_rows[seqs[row].seq_id] for row in inflight_rows]
    for row in range(batch.num_decode, len(batch.seqs)):
        seq, start, q = batch.seqs[row], batch.starts[row], batch.query_lens[row]
        extra = batch.drafts.get(row)
        if extra is None:
            input_ids += seq.token_ids[start:start + q]
        else:  # a row of several: its token (0 if not on the host: placed on the device), then those filled in
            input_ids += seq.token_ids[start:start + 1] or [0]
            input_ids += extra
    return StepInput(batch.num_decode, batch.starts, batch.query_lens, input_ids,
                     [seq.block_table for seq in batch.seqs], inflight_rows, inflight_sources)
