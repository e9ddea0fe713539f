"""A step's rows of several tokens (a decoding row with proposals filled in after its last one, by
speculative decoding's row planner) expand into one sampling row per position. Each sees the
tokens before it as if they were accepted (`DraftView`): that is what makes penalties, seeds,
min_tokens, bad words and logprobs exact at every position."""
from nanoinfer.engine.scheduler import ScheduledBatch


class DraftView:
    """A sequence as it would be with `extra` (proposed tokens) appended, for the sampling plan
    (sampling/plan.py reads these attributes). Counted in flight like the row's own sample."""
    __slots__ = ("seq", "extra")
    num_inflight = 1

    def __init__(self, seq, extra: list[int]):
        self.seq, self.extra = seq, extra

    @property
    def seq_id(self):
        return self.seq.seq_id

    @property
    def sampling_params(self):
        return self.seq.sampling_params

    @property
    def num_prompt_tokens(self):
        return self.seq.num_prompt_tokens

    @property
    def token_ids(self):
        return self.seq.token_ids + self.extra if self.extra else self.seq.token_ids

    @property
    def num_completion_tokens(self):
        return self.seq.num_completion_tokens + len(self.extra)


def sampling_rows(batch: ScheduledBatch) -> tuple[list, list[bool], list[int]]:
    """(sequences or DraftViews, their `samples` flags, their flat token rows) for every sampling
    row: one per row (its last token), m + 1 for a row with m proposals (every query token)."""
    seqs, samples, token_rows = [], [], []
    end = 0
    for row, (seq, q) in enumerate(zip(batch.seqs, batch.query_lens)):
        end += q
        draft = batch.drafts.get(row)
        if draft is None:
            seqs.append(seq)
            samples.append(batch.samples[row])
            token_rows.append(end - 1)
            continue
        for j in range(len(draft) + 1):
            seqs.append(DraftView(seq, draft[:j]))
            samples.append(True)
            token_rows.append(end - 1 - len(draft) + j)
    return seqs, samples, token_rows
