"""A step message -> the forward's flat inputs and its attention context (utils/context.py).

Decode rows (one query token each) come first. A decode-only step sets a decode context (and can
replay a CUDA graph); any other step runs every row as a prefill, a decode row being a query of
length 1. Padded block-table entries are -1."""
from itertools import accumulate

import torch

from nanoinfer.engine.step_message import StepInput
from nanoinfer.utils.context import get_context, set_context
from nanoinfer.utils.device_copy import to_device


def slots_of(table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots of positions start..end-1 of a sequence with this block table."""
    bs, slots = block_size, []
    for i in range(start // bs, (end - 1) // bs + 1):
        lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
        base = table[i] * bs - i * bs
        slots.extend(range(base + lo, base + hi))
    return slots


def padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    return [t + [-1] * (width - len(t)) for t in tables]


def prepare_inputs(step: StepInput, block_size: int, device: torch.device, sort_decode_rows: bool,
                   prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, positions) on the device, with the step's context set. In-flight rows read
    their token from `prev_tokens`, the tokens of the step launched before this one.
    sort_decode_rows: the attention backend wants a decode step's rows longest context first."""
    if step.is_decode_only:
        input_ids, positions = _decode_context(step, block_size, device, sort_decode_rows)
    else:
        input_ids, positions = _prefill_context(step, block_size, device)
    if step.prompt_logit_rows or step.sample_rows is not None:
        # the sampling rows' logits (each row's last token, unless named), then those prompt positions'
        rows = step.sample_rows if step.sample_rows is not None else [end - 1 for end in accumulate(step.query_lens)]
        get_context().logits_indices = to_device(rows + (step.prompt_logit_rows or []), torch.int64, device)
    if step.lora is not None:  # each token's adapter slot: its row's
        slots = step.lora.row_slots
        if not step.is_decode_only:
            slots = [s for s, q in zip(slots, step.query_lens) for _ in range(q)]
        get_context().lora_slots = to_device(slots, torch.int64, device)
    if step.rope_positions is not None:  # M-RoPE: [N], or [3, N] in a step with image tokens
        rope = torch.tensor(step.rope_positions, dtype=torch.int64)
        positions = (rope[0] if rope.shape[0] == 1 else rope).to(device, non_blocking=True)
    if step.inflight_rows:
        tokens = prev_tokens.index_select(0, to_device(step.inflight_sources, torch.int64, device))
        if len(step.inflight_rows) == input_ids.shape[0]:  # every row: one gather
            input_ids = tokens
        else:
            input_ids[to_device(step.inflight_rows, torch.int64, device)] = tokens
    return input_ids, positions


def _decode_context(step: StepInput, block_size: int, device: torch.device, sort_rows: bool):
    bs = block_size
    positions = step.starts
    slots = [table[start // bs] * bs + start % bs for start, table in zip(positions, step.block_tables)]
    context_lens = [start + 1 for start in positions]
    order = None
    if sort_rows:  # the decode kernel starts the longest contexts first
        order = to_device(sorted(range(len(positions)), key=context_lens.__getitem__, reverse=True), torch.int32,
                          device)
    set_context(is_prefill=False, slot_mapping=to_device(slots, torch.int64, device),
                context_lens=to_device(context_lens, torch.int32, device),
                block_tables=to_device(padded(step.block_tables), torch.int32, device),
                decode_order=order, context_lens_cpu=context_lens)
    return to_device(step.input_ids, torch.int64, device), to_device(positions, torch.int64, device)


def _prefill_context(step: StepInput, block_size: int, device: torch.device):
    positions, slots, context_lens = [], [], []
    for start, q, table in zip(step.starts, step.query_lens, step.block_tables):
        end = start + q
        positions.extend(range(start, end))
        slots.extend(slots_of(table, block_size, start, end))
        context_lens.append(end)
    i32 = torch.int32
    cu_q = [0, *accumulate(step.query_lens)]
    cu_k = [0, *accumulate(context_lens)]
    set_context(is_prefill=True, cu_seqlens_q=to_device(cu_q, i32, device), cu_seqlens_k=to_device(cu_k, i32, device),
                max_seqlen_q=max(step.query_lens), max_seqlen_k=max(context_lens),
                slot_mapping=to_device(slots, torch.int64, device), context_lens=to_device(context_lens, i32, device),
                block_tables=to_device(padded(step.block_tables), i32, device),
                query_lens_cpu=list(step.query_lens), context_lens_cpu=context_lens)
    return to_device(step.input_ids, torch.int64, device), to_device(positions, torch.int64, device)
