"""A step's query tokens that a proposer left on the device (speculative/proposer.py): the target's
verify step, or a draft's catch-up of chained rows, is launched without waiting for them. The runner
takes them as its launch's `on_device` (engine/forward_inputs.py): `stage` queues the index arrays
with the step's own, `place` writes the tokens into the step's inputs and, for rows chained onto a
row in flight (speculative/chaining.py), moves their positions back by what that row rejected. Such
a step runs as a decode step of short rows (each token a row of its own with its sequence's block
table): its slots and context lengths then follow the moved positions."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DeviceTokens:
    """Flat token rows `rows` of a step read tokens.reshape(-1)[sources]; with `offsets` (one per
    row of `tokens`, <= 0), their positions move by their row's offset."""
    tokens: torch.Tensor                  # [rows, width] int64
    rows: list[int]
    sources: list[int]
    offsets: torch.Tensor | None = None   # [rows] int64

    def stage(self, staged) -> tuple[int, int]:
        return staged.add(self.rows), staged.add(self.sources)

    def place(self, sent: list, parts: tuple[int, int], input_ids: torch.Tensor, positions: torch.Tensor,
              context: dict, block_size: int) -> None:
        rows, sources = sent[parts[0]], sent[parts[1]]
        input_ids[rows] = self.tokens.reshape(-1).index_select(0, sources)
        if self.offsets is None:
            return
        if context["is_prefill"]:
            raise RuntimeError("a step with rows shifted on the device must run as a step of short rows")
        positions[rows] += self.offsets.index_select(0, sources // self.tokens.shape[1])
        # (each token a row of its own: context = position + 1)
        context["slot_mapping"] = device_cache_slots(context["block_tables"], positions[:, None], block_size).squeeze(1)
        context["context_lens"] = (positions + 1).to(torch.int32)
        context["context_lens_cpu"] = context["context_lens"].tolist() if positions.device.type == "cpu" else None


def verify_inputs(batch) -> DeviceTokens:
    """The verify step's tokens on the device: those of the batch's rows whose whole query the
    proposer left there (batch.proposals, a DeviceProposals: the row's first token, then its
    proposals)."""
    props = batch.proposals
    width = props.tokens.shape[1]
    rows, sources, flat = [], [], 0
    for row, (seq, q) in enumerate(zip(batch.seqs, batch.query_lens)):
        i = props.index.get(seq.seq_id) if row in batch.drafts else None
        if i is not None:
            rows += range(flat, flat + q)
            sources += range(i * width, i * width + q)
        flat += q
    return DeviceTokens(props.tokens, rows, sources, props.offsets)


def device_cache_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots of positions [rows, m] of the rows whose block tables are block_tables
    [rows, width], on the device."""
    return block_tables.gather(1, positions // block_size) * block_size + positions % block_size
