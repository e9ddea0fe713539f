"""A decode step's inputs -> a decode CUDA graph's static buffers, in one kernel.

The graph of batch bucket B reads the first B rows of its static buffers: token ids, positions,
cache slots, context lengths, block tables and (for the Triton decode kernel) the rows' order.
Filling them with a copy or fill per buffer cost the host a launch each (with the slicing around
it) on every decode step; this writes them all in one launch, a program per tile of rows and
block-table columns (the first column of programs also writes the per-row values). Rows n..B-1
are padding: slot -1 (no K/V written), context 0 (attention writes zeros) and, in the order, last.
Block tables are copied over the step's width only: a row's entries past its context are never
read. A step sampled inside the graphs (graph_runner.py) also sends its rows' temperatures
(padding: 0, greedy) and its seed.
Integers that change from step to step are not specialised on (no compile while serving).
"""
import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64
BLOCK_COLS = 32


@triton.jit(do_not_specialize=["n", "bucket", "width", "bt_src_stride", "seed"])
def _fill_kernel(ids_src, pos_src, slot_src, ctx_src, bt_src, order_src, temp_src,
                 ids_dst, pos_dst, slot_dst, ctx_dst, bt_dst, order_dst, temp_dst, seed_dst,
                 n, bucket, width, bt_src_stride, bt_dst_stride, seed,
                 HAS_ORDER: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_COLS: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < n
    if tl.program_id(1) == 0:
        out = r < bucket
        if SAMPLE:
            tl.store(temp_dst + r, tl.load(temp_src + r, mask=live, other=0.0), mask=out)
            if tl.program_id(0) == 0:
                tl.store(seed_dst, seed.to(tl.int64))
        tl.store(ids_dst + r, tl.load(ids_src + r, mask=live, other=0), mask=live)
        tl.store(pos_dst + r, tl.load(pos_src + r, mask=live, other=0), mask=live)
        tl.store(slot_dst + r, tl.load(slot_src + r, mask=live, other=-1), mask=out)
        tl.store(ctx_dst + r, tl.load(ctx_src + r, mask=live, other=0), mask=out)
        if HAS_ORDER:
            order = tl.load(order_src + r, mask=live, other=0)
            tl.store(order_dst + r, tl.where(live, order, r), mask=out)
    rows = r.to(tl.int64)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    m = live[:, None] & (c[None, :] < width)
    table = tl.load(bt_src + rows[:, None] * bt_src_stride + c[None, :], mask=m)
    tl.store(bt_dst + rows[:, None] * bt_dst_stride + c[None, :], table, mask=m)


def fill_decode_graph_inputs(g: dict[str, torch.Tensor], bucket: int, input_ids: torch.Tensor,
                             positions: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, decode_order: torch.Tensor | None,
                             temperatures: torch.Tensor | None = None, seed: int = 0):
    """The step's n rows into the first n rows of the static buffers `g` (graph_runner.py's names),
    and rows n..bucket-1 as padding. decode_order None: the graph reads no order. temperatures
    ([n] float32) and seed (in [0, 2^31)): a step sampled in the graphs, into g["temperatures"]
    and g["seed"]."""
    n, width = block_tables.shape
    for name, t in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping),
                    ("context_lens", context_lens), ("decode_order", decode_order),
                    ("temperatures", temperatures)):
        if t is not None and (t.shape != (n,) or t.dtype != g[name].dtype or not t.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous [{n}] {g[name].dtype} tensor, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if block_tables.dtype != g["block_tables"].dtype or block_tables.stride(1) != 1 or \
            width > g["block_tables"].shape[1] or not n <= bucket <= g["context_lens"].shape[0]:
        raise ValueError(f"block tables {tuple(block_tables.shape)} {block_tables.dtype} or bucket {bucket} do not "
                         f"fit the graph's buffers {tuple(g['block_tables'].shape)}")
    if temperatures is not None and not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2^31), got {seed}")
    order = decode_order if decode_order is not None else context_lens
    sample = temperatures is not None
    _fill_kernel[(triton.cdiv(bucket, BLOCK_ROWS), triton.cdiv(width, BLOCK_COLS))](
        input_ids, positions, slot_mapping, context_lens, block_tables, order,
        temperatures if sample else g["temperatures"],
        g["input_ids"], g["positions"], g["slot_mapping"], g["context_lens"], g["block_tables"], g["decode_order"],
        g["temperatures"], g["seed"], n, bucket, width, block_tables.stride(0), g["block_tables"].stride(0), seed,
        HAS_ORDER=decode_order is not None, SAMPLE=sample, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
