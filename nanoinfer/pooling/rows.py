"""The pooling seam of a step, on both sides of the step message.

Host: `pooling_rows` reads a batch of embedding requests into PoolingRows (which flat token rows
each segment sums); `record_pooled` hands the step's sums back to the requests' PoolingStates.
Both walk the batch the same way, so segment i is the same row in both.
Device: `pool_hidden` sums the final hidden states of each segment's rows, in float32."""
from dataclasses import dataclass

import torch

from nanoinfer.step.sequence import SequenceStatus
from nanoinfer.utils.device_copy import to_device


POOLING = "pooling"  # the key of a step's PoolingRows in StepInput.parts


@dataclass(slots=True)
class PoolingRows:
    """An embedding step (runner="pooling", nanoinfer/pooling): instead of sampling, the rank sums
    the final hidden states of flat token rows starts[i] .. starts[i] + counts[i] - 1 for each
    segment i (a prompt's last token, its first, or a chunk's every token)."""
    starts: list[int]
    counts: list[int]


def _segments(batch):
    """(row, start, offset of the row's first token in the flat step, (offset in row, count))."""
    flat = 0
    for seq, start, q in zip(batch.seqs, batch.starts, batch.query_lens):
        segment = seq.pooling.segment(start, q)
        if segment is not None:
            yield seq, start, flat, segment
        flat += q


def pooling_rows(batch) -> PoolingRows:
    starts, counts = [], []
    for _, _, flat, (offset, count) in _segments(batch):
        starts.append(flat + offset)
        counts.append(count)
    return PoolingRows(starts, counts)


def record_pooled(batch, pooled: torch.Tensor):
    """Give each segment's sum to its sequence, unless the sequence stopped running meanwhile
    (preempted or aborted: the rows it recomputes will bring fresh sums)."""
    for i, (seq, start, _, _) in enumerate(_segments(batch)):
        if seq.status == SequenceStatus.RUNNING:
            seq.pooling.add(start, pooled[i])


def pool_hidden(hidden: torch.Tensor, rows: PoolingRows) -> torch.Tensor:
    """[segments, hidden] float32: segment i sums hidden[starts[i] : starts[i] + counts[i]]."""
    device = hidden.device
    if all(c == 1 for c in rows.counts):  # last token or CLS: a gather
        return hidden[to_device(rows.starts, torch.int64, device)].float()
    counts = to_device(rows.counts, torch.int64, device)
    total = sum(rows.counts)  # (given, so that the device is not asked for it)
    seg = torch.repeat_interleave(torch.arange(len(rows.counts), device=device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts  # each segment's first index in the flat gather
    index = to_device(rows.starts, torch.int64, device)[seg] + torch.arange(total, device=device) - first[seg]
    out = torch.zeros(len(rows.counts), hidden.shape[1], dtype=torch.float32, device=device)
    return out.index_add_(0, seg, hidden[index].float())
