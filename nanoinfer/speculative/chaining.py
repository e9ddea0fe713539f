"""A speculative row chained onto the sequence's row still in flight, with overlapped steps.

The host schedules step N+1 before step N's tokens reach it. A sequence whose row in step N
scores k proposals ends that step somewhere in [L + 1, L + k + 1] tokens, which only the device
knows. Its row in step N+1 is scheduled as if all k were accepted (engine/scheduler.py: blocks,
progress and length limits count the worst case), and the device corrects it before running it:

- `chained_inputs` compares step N's samples with its proposals on the device: `accepted`, the
  count of leading proposals the target sampled too; the bonus token (the target's own sample
  after them), which is the new row's first query token; the token before it (the last accepted
  proposal, or the row's own first token), which the draft model forwards again with the bonus to
  catch its K/V up; and the shift, accepted - k, which moves the row's positions, cache slots and
  context lengths back where they belong (speculative/device_inputs.py, speculative/draft_chain.py).
- The draft proposes from there (speculative/draft_model.py), and the verify step reads its whole query
  (bonus and proposals) on the device.

No token makes a host round trip between the steps. Only requests whose proposals are the draft's
argmax chain (their sampling plan reads no proposal), on one rank, and only in steps that run as
decode steps of short rows: the scheduler keeps prompt chunks out of them (`_chain_room`).
"""
from dataclasses import dataclass

import torch

from nanoinfer.speculative.proposer import DeviceProposals
from nanoinfer.utils.staging import Staging


@dataclass(slots=True)
class ChainedRows:
    """The rows (indices into a proposer's launch) chained onto rows in flight, and per row on the
    device: the token before the bonus, the bonus, and the shift of its positions (<= 0)."""
    rows: list[int]
    last: torch.Tensor
    bonus: torch.Tensor
    shift: torch.Tensor


def chained_inputs(prev: DeviceProposals, prev_tokens: torch.Tensor, seq_ids: list[int]):
    """(last, bonus, shift) [rows] int64 on the device for the rows of `seq_ids` (each row's
    sequence has a row in `prev`, the step in flight, whose sampled tokens are `prev_tokens`)."""
    rows = [prev.index[s] for s in seq_ids]
    staged = Staging()
    parts = [staged.add(rows), staged.add([prev.lengths[i] for i in rows]),
             staged.add([prev.first_samples[i] for i in rows])]
    sent = staged.send(prev.tokens.device)
    index, k, first = (sent[i] for i in parts)
    queries = prev.tokens.index_select(0, index)  # [rows, 1 + width]: first token, then proposals
    width = queries.shape[1] - 1
    cols = torch.arange(width + 1, device=queries.device)
    # the target's sample at each position (a row with fewer proposals repeats its last)
    sampled = prev_tokens[first[:, None] + torch.minimum(cols[None, :], k[:, None])]
    agree = (sampled[:, :width] == queries[:, 1:]) & (cols[None, :width] < k[:, None])
    accepted = agree.long().cumprod(1).sum(1, keepdim=True)
    bonus = sampled.gather(1, accepted).squeeze(1)
    last = queries.gather(1, accepted).squeeze(1)
    return last, bonus, accepted.squeeze(1) - k
