"""A decode step's inputs into a decode graph's static buffers in one kernel
(kernels/graph_inputs.py), against the per-buffer copies it replaces: every value the graph of the
bucket reads is the same, over buffers left dirty by a larger step before."""
import random

import pytest
import torch

from nanoinfer.engine.graph_runner import GraphRunner
from nanoinfer.kernels.graph_inputs import fill_decode_graph_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MAX_SEQS, WIDTH = 80, 40  # more rows than one program's block, more columns than one chunk


def buffers():
    runner = GraphRunner(None, MAX_SEQS, 256, WIDTH, 8, torch.float32, torch.device(DEV), mixed_steps=False,
                         sorts_decode_rows=True)
    g = runner._allocate_buffers(256)
    gen = torch.Generator().manual_seed(1)
    for t in g.values():  # a larger step's leftovers
        t.copy_(torch.randint(-5, 1000, t.shape, generator=gen).to(t.dtype))
    return g


def step(n, width, rng):
    ids = torch.tensor([rng.randrange(1000) for _ in range(n)], dtype=torch.int64, device=DEV)
    pos = torch.tensor([rng.randrange(10000) for _ in range(n)], dtype=torch.int64, device=DEV)
    slots = torch.tensor([rng.randrange(-1, 10000) for _ in range(n)], dtype=torch.int64, device=DEV)
    ctx = torch.tensor([rng.randrange(1, 10000) for _ in range(n)], dtype=torch.int32, device=DEV)
    tables = torch.tensor([[rng.randrange(-1, 500) for _ in range(width)] for _ in range(n)], dtype=torch.int32,
                          device=DEV)
    order = torch.tensor(rng.sample(range(n), n), dtype=torch.int32, device=DEV)
    return ids, pos, slots, ctx, tables, order


@pytest.mark.parametrize("n, bucket, width, with_order", [
    (1, 1, 1, True), (3, 4, 7, True), (64, 64, 33, False), (65, 80, 40, True), (50, 64, 32, True), (5, 8, 40, False)])
def test_the_graph_reads_what_the_per_buffer_copies_gave(n, bucket, width, with_order):
    rng = random.Random(n * 1000 + width)
    ids, pos, slots, ctx, tables, order = step(n, width, rng)
    order = order if with_order else None
    g = buffers()
    before_order = g["decode_order"].clone()
    fill_decode_graph_inputs(g, bucket, ids, pos, slots, ctx, tables, order)
    assert torch.equal(g["input_ids"][:n], ids) and torch.equal(g["positions"][:n], pos)
    assert g["slot_mapping"][:bucket].tolist() == slots.tolist() + [-1] * (bucket - n)
    assert g["context_lens"][:bucket].tolist() == ctx.tolist() + [0] * (bucket - n)
    assert torch.equal(g["block_tables"][:n, :width], tables)
    if with_order:  # padded rows (context 0) last
        assert g["decode_order"][:bucket].tolist() == order.tolist() + list(range(n, bucket))
    else:
        assert torch.equal(g["decode_order"], before_order)


def test_a_step_that_does_not_fit_the_buffers_is_refused():
    ids, pos, slots, ctx, tables, order = step(4, WIDTH + 1, random.Random(0))
    with pytest.raises(ValueError, match="do not fit"):
        fill_decode_graph_inputs(buffers(), 4, ids, pos, slots, ctx, tables, order)
    ids, pos, slots, ctx, tables, order = step(4, 3, random.Random(0))
    with pytest.raises(ValueError, match="context_lens"):
        fill_decode_graph_inputs(buffers(), 4, ids, pos, slots, ctx.long(), tables, order)


@pytest.mark.parametrize("n, bucket", [(1, 1), (3, 4), (65, 80)])
def test_a_step_sampled_in_the_graphs_sends_its_temperatures_and_seed(n, bucket):
    """Padded rows get temperature 0 (greedy: no noise drawn for them); the seed goes to its buffer."""
    rng = random.Random(n)
    ids, pos, slots, ctx, tables, order = step(n, 5, rng)
    t = torch.tensor([rng.random() for _ in range(n)], dtype=torch.float32, device=DEV)
    g = buffers()
    fill_decode_graph_inputs(g, bucket, ids, pos, slots, ctx, tables, order, t, 2**31 - 5)
    assert g["temperatures"][:bucket].tolist() == t.tolist() + [0.0] * (bucket - n)
    assert g["seed"].tolist() == [2**31 - 5] and torch.equal(g["input_ids"][:n], ids)
    with pytest.raises(ValueError, match="temperatures"):
        fill_decode_graph_inputs(g, bucket, ids, pos, slots, ctx, tables, order, t.double(), 1)
    with pytest.raises(ValueError, match="seed"):
        fill_decode_graph_inputs(g, bucket, ids, pos, slots, ctx, tables, order, t, 2**31)
