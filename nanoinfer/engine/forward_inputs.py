"""A step message -> the forward's flat inputs and its attention context (utils/context.py).

Decode rows (one query token each) come first. A decode-only step gets a decode context, and so
does a step of few short rows (a speculative verify step, a draft's catch-up): each token becomes a
decode row of its own, attending to its sequence up to itself, which is causal attention. That reads
the K/V once per token instead of once per row, yet costs less than a prefill launch over few, short
rows. Any other step runs every row as a prefill. Padded block-table entries are -1."""
from itertools import accumulate, chain

import numpy as np
import torch

from nanoinfer.step.step_message import StepInput
from nanoinfer.utils.context import set_context
from nanoinfer.utils.staging import Staging

# a step of at most this many tokens (and at most the largest decode graph's), no row longer than
# this many, runs as a decode step, a token a row
SHORT_ROWS_MAX_QUERY = 8
SHORT_ROWS_MAX_TOKENS = 256


def prepare_inputs(step: StepInput, block_size: int, device: torch.device, sort_decode_rows: bool,
                   prev_tokens: torch.Tensor | None, max_short_tokens: int = SHORT_ROWS_MAX_TOKENS,
                   on_device=None, fields: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, positions) on the device, with the step's context set. In-flight rows read
    their token from `prev_tokens` (the step launched before this one's). `on_device`: tokens a
    proposer left on the device (speculative/device_inputs.py): `stage` queues its index arrays
    with the step's, `place` writes them into the inputs (and may move positions). `fields`: the
    features' context fields (RankFeature.before_forward); one named as an input replaces it
    (M-RoPE's `positions`). max_short_tokens: the runner's largest decode graph.
    Every index array goes in one staging buffer, sent in one copy: Python lists for a decode
    step (a value per row), numpy over the whole step for the others (a value per token)."""
    staged = Staging()
    short_rows = False
    if step.is_decode_only:
        names, context = _decode_context(step, block_size, staged, sort_decode_rows)
        num_tokens = step.num_rows
    else:
        rows = StepArrays(step, block_size)
        # (a feature's steps, StepInput.prefill, stay on the prefill path: images, M-RoPE, embeddings)
        short_rows = len(step.input_ids) <= max_short_tokens and max(step.query_lens) <= SHORT_ROWS_MAX_QUERY \
            and not step.prefill
        names, context = _short_rows_context(rows, staged, sort_decode_rows) if short_rows else \
            _prefill_context(rows, staged)
        num_tokens = rows.num_tokens
    if step.extra_logit_rows or step.sample_rows is not None or short_rows:
        # the sampling rows' logits (each row's last token, unless named), then the rows features read
        last = step.sample_rows if step.sample_rows is not None else list(accumulate(step.query_lens, initial=-1))[1:]
        names["logits_indices"] = staged.add(last + (step.extra_logit_rows or []))
    if fields:
        for name, value in fields.items():
            if isinstance(value, (list, np.ndarray)):
                names[name] = staged.add(value)
        context = {**fields, **context}
    if step.inflight_rows:
        names["inflight_sources"] = staged.add(step.inflight_sources)
        if len(step.inflight_rows) != num_tokens:
            names["inflight_rows"] = staged.add(step.inflight_rows)
    placed = on_device.stage(staged) if on_device is not None else None
    sent = staged.send(device)
    for name, i in names.items():
        context[name] = sent[i]
    input_ids, positions = context.pop("input_ids"), context.pop("positions")
    sources, inflight_rows = context.pop("inflight_sources", None), context.pop("inflight_rows", None)
    if on_device is not None:
        on_device.place(sent, placed, input_ids, positions, context, block_size)
    set_context(**context)  # block tables, slots, lengths (and logits_indices, the features' fields)
    if sources is not None:
        tokens = prev_tokens.index_select(0, sources)
        if inflight_rows is None:  # every row: one gather
            input_ids = tokens
        else:
            input_ids[inflight_rows] = tokens
    return input_ids, positions


def padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """The rows' block tables padded with -1 into one [rows, width] int64 array."""
    lens = list(map(len, tables))
    width = max(lens)
    flat = np.fromiter(chain.from_iterable(tables), np.int64, sum(lens))
    if min(lens) == width:  # no padding (a single row, say)
        return flat.reshape(len(tables), width)
    padded = np.full((len(tables), width), -1, np.int64)
    padded[np.arange(width) < np.array(lens)[:, None]] = flat
    return padded


class StepArrays:
    """A step's rows as numpy arrays (starts, query lengths, padded block tables), and per flat
    token its row, position and cache slot."""

    def __init__(self, step: StepInput, block_size: int):
        self.step = step
        self.starts = np.array(step.starts, np.int64)
        self.query_lens = q = np.array(step.query_lens, np.int64)
        self.num_tokens = len(step.input_ids)
        self.block_tables = padded_block_tables(step.block_tables)
        self.cu_q = np.zeros(len(q) + 1, np.int64)  # cumulative query lengths, from 0
        np.cumsum(q, out=self.cu_q[1:])
        self.token_rows = np.repeat(np.arange(len(q)), q)
        self.positions = np.arange(self.num_tokens) + np.repeat(self.starts - self.cu_q[:-1], q)
        self.slots = cache_slots(self.block_tables, self.token_rows, self.positions, block_size)


def cache_slots(block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slots of `positions` of the sequences whose padded block tables are block_tables[rows]."""
    block, offset = np.divmod(positions, block_size)
    return block_tables[rows, block] * block_size + offset


def _decode_context(step: StepInput, bs: int, staged: Staging, sort_rows: bool) -> tuple[dict[str, int], dict]:
    """The staged arrays' indices by context field, and the context's other fields."""
    positions = step.starts
    context_lens = [start + 1 for start in positions]
    slots = [table[start // bs] * bs + start % bs for start, table in zip(positions, step.block_tables)]
    names = dict(input_ids=staged.add(step.input_ids), positions=staged.add(positions),
                 slot_mapping=staged.add(slots), context_lens=staged.add(context_lens, np.int32),
                 block_tables=staged.add(padded_block_tables(step.block_tables), np.int32))
    if sort_rows:  # the decode kernel starts the longest contexts first (ties in row order)
        order = sorted(range(len(positions)), key=context_lens.__getitem__, reverse=True)
        names["decode_order"] = staged.add(order, np.int32)
    return names, dict(is_prefill=False, context_lens_cpu=context_lens)


def _short_rows_context(rows: StepArrays, staged: Staging, sort_rows: bool) -> tuple[dict[str, int], dict]:
    """A decode context with a row per token: its sequence's block table, its position + 1 tokens of
    context."""
    context_lens = rows.positions + 1
    names = dict(input_ids=staged.add(rows.step.input_ids), positions=staged.add(rows.positions),
                 slot_mapping=staged.add(rows.slots), context_lens=staged.add(context_lens, np.int32),
                 block_tables=staged.add(rows.block_tables[rows.token_rows], np.int32))
    if sort_rows:  # (as _decode_context; a stable sort keeps ties in row order)
        names["decode_order"] = staged.add(np.argsort(-context_lens, kind="stable"), np.int32)
    return names, dict(is_prefill=False, context_lens_cpu=context_lens.tolist())


def _prefill_context(rows: StepArrays, staged: Staging) -> tuple[dict[str, int], dict]:
    q = rows.query_lens
    context_lens = rows.starts + q
    cu_k = np.zeros(len(q) + 1, np.int64)
    np.cumsum(context_lens, out=cu_k[1:])
    names = dict(input_ids=staged.add(rows.step.input_ids), positions=staged.add(rows.positions),
                 cu_seqlens_q=staged.add(rows.cu_q, np.int32), cu_seqlens_k=staged.add(cu_k, np.int32),
                 slot_mapping=staged.add(rows.slots),
                 context_lens=staged.add(context_lens, np.int32), block_tables=staged.add(rows.block_tables, np.int32))
    return names, dict(is_prefill=True, max_seqlen_q=int(q.max()), max_seqlen_k=int(context_lens.max()),
                       query_lens_cpu=list(rows.step.query_lens), context_lens_cpu=context_lens.tolist())
