"""One staging buffer per step (utils/staging.py), the sampler's column cache, and the step's
inputs built from it (engine/forward_inputs.py) against the per-row rules they replace."""
import random

import numpy as np
import pytest
import torch

from nanoinfer.engine.forward_inputs import prepare_inputs
from nanoinfer.step.step_message import StepInput
from nanoinfer.sampling.column_cache import ColumnCache
from nanoinfer.utils.context import get_context, reset_context
from nanoinfer.utils.staging import Staging

CPU = torch.device("cpu")


def test_parts_of_every_dtype_and_shape_come_back_as_given():
    staged = Staging()
    parts = [([5, -1, 7], np.int64), (np.arange(6).reshape(2, 3), np.int32), ([0.5, 2.0], np.float32),
             ([], np.int64), (np.array([1, 2**40], np.int64), np.int64), ([3], np.int32)]
    for data, dtype in parts:
        staged.add(data, dtype)
    sent = staged.send(CPU)
    for t, (data, dtype) in zip(sent, parts):
        expected = torch.from_numpy(np.asarray(data, dtype=dtype))
        assert t.dtype == expected.dtype and t.shape == expected.shape and torch.equal(t, expected)


def test_every_part_starts_16_byte_aligned():
    """As its own allocation would: Triton compiles a kernel variant per pointer alignment, so parts
    whose alignment varied with the sizes before them would compile new variants while serving."""
    staged = Staging()
    for n in (3, 1, 5, 2):  # odd int32 / int64 lengths that would leave 4- or 8-byte offsets
        staged.add(list(range(n)), np.int32)
        staged.add(list(range(n)), np.int64)
    sent = staged.send(CPU)
    base = min(t.data_ptr() for t in sent)
    assert all((t.data_ptr() - base) % 16 == 0 for t in sent)


def test_a_column_equal_to_the_last_reuses_its_tensor():
    cache = ColumnCache(CPU)
    first = cache.get("temperatures", [0.5, 0.0], torch.float32)
    assert cache.get("temperatures", [0.5, 0.0], torch.float32) is first
    other = cache.get("temperatures", [0.5, 0.7], torch.float32)
    assert other is not first and other.tolist() == pytest.approx([0.5, 0.7])
    assert cache.get("top_k", [0.5, 0.7], torch.int64).dtype == torch.int64  # each name its own


def reference(step: StepInput, bs: int):
    """The per-row rules: each token's position and cache slot, each row's context length, block
    tables padded with -1."""
    positions, slots, context_lens = [], [], []
    for start, q, table in zip(step.starts, step.query_lens, step.block_tables):
        for p in range(start, start + q):
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        context_lens.append(start + q)
    width = max(len(t) for t in step.block_tables)
    return positions, slots, context_lens, [t + [-1] * (width - len(t)) for t in step.block_tables]


@pytest.mark.parametrize("seed", range(20))
def test_inputs_equal_the_per_row_rules(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    n = rng.randint(1, 12)
    num_decode = rng.randint(0, n)
    starts, query_lens, tables, free = [], [], [], list(range(1000))
    rng.shuffle(free)
    for row in range(n):
        q = 1 if row < num_decode else rng.randint(1, 40)
        start = rng.randint(0, 60)
        starts.append(start)
        query_lens.append(q)
        tables.append([free.pop() for _ in range((start + q - 1) // bs + 1 + rng.randint(0, 2))])
    input_ids = [rng.randint(0, 99) for _ in range(sum(query_lens))]
    step = StepInput(num_decode, starts, query_lens, input_ids, tables)
    sort = rng.random() < 0.5
    try:
        ids, positions = prepare_inputs(step, bs, CPU, sort, None)
        ctx = get_context()
        want_positions, want_slots, want_lens, want_tables = reference(step, bs)
        assert ids.tolist() == input_ids and ids.dtype == torch.int64
        assert positions.tolist() == want_positions and positions.dtype == torch.int64
        assert ctx.slot_mapping.tolist() == want_slots and ctx.slot_mapping.dtype == torch.int64
        assert ctx.context_lens.tolist() == want_lens and ctx.context_lens.dtype == torch.int32
        assert ctx.context_lens_cpu == want_lens
        assert ctx.block_tables.tolist() == want_tables and ctx.block_tables.dtype == torch.int32
        if step.is_decode_only:
            assert not ctx.is_prefill
            if sort:  # longest context first, ties in row order
                assert ctx.decode_order.tolist() == sorted(range(n), key=lambda r: -want_lens[r])
        else:
            assert ctx.is_prefill and ctx.query_lens_cpu == query_lens
            cu_q = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
            assert ctx.cu_seqlens_q.tolist() == cu_q and ctx.cu_seqlens_q.dtype == torch.int32
            assert ctx.cu_seqlens_k.tolist() == np.concatenate([[0], np.cumsum(want_lens)]).tolist()
            assert ctx.max_seqlen_q == max(query_lens) and ctx.max_seqlen_k == max(want_lens)
    finally:
        reset_context()
