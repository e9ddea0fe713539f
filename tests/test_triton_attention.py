"""Triton paged attention vs the torch reference (CPU: Triton interpreter, tiny shapes; GPU: real)."""
import math
import random

import pytest
import torch

from nanoinfer.kernels import triton_attention as ta
from nanoinfer.kernels.arrival_counters import ArrivalCounters
from nanoinfer.kernels.torch_attention import paged_attention_torch
from nanoinfer.kernels.triton_attention import (PREFILL_CFG, SHORT_PREFILL_CFG, decode_attention,
                                                decode_num_splits, prefill_attention, prefill_config,
                                                prefill_heads_per_program)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device=DEV):
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return k, v


def make_block_tables(context_lens, block_size, num_blocks, width=None, device=DEV):
    """Random non-identity assignment of distinct physical blocks; -1 beyond the used ones."""
    need = [(c + block_size - 1) // block_size for c in context_lens]
    width = width or max(max(need), 1)
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks).tolist()
    bt = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = torch.tensor(perm[pos:pos + n], dtype=torch.int32)
        pos += n
    return bt.to(device)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_prefill(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                strided_q=False, extra_blocks=3, device=DEV, config=None):
    num_blocks = sum((c + block_size - 1) // block_size for c in ctx_lens) + extra_blocks
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    bt = make_block_tables(ctx_lens, block_size, num_blocks, device=device)
    total = sum(q_lens)
    if strided_q:  # q as a view into a fused qkv row
        qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        q = qkv[:, :num_heads * head_dim].view(total, num_heads, head_dim)
    else:
        q = torch.randn(total, num_heads, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32,
                      device=device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = prefill_attention(q, k_cache, v_cache, cu, ctx, bt, max(q_lens), scale, config=config)
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), q_lens, ctx_lens, bt, scale)
    assert out.shape == (total, num_heads, head_dim) and out.dtype == dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    return rel_err(out, ref)


def run_decode(ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, width=None,
               num_splits=None, config=None, device=DEV, ordered=False, fp8=False):
    num_blocks = sum((c + block_size - 1) // block_size for c in ctx_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    k_scale = v_scale = None
    if fp8:  # an FP8 cache with non-unit scales; the reference reads it dequantized
        k_scale = torch.tensor(0.05, device=device)
        v_scale = torch.tensor(0.02, device=device)
        k_cache = (k_cache.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    bt = make_block_tables(ctx_lens, block_size, num_blocks, width=width, device=device)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, dtype=dtype, device=device)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    order = None
    if ordered:  # longest first, as the model runner passes it
        order = torch.tensor(sorted(range(len(ctx_lens)), key=lambda i: -ctx_lens[i]), dtype=torch.int32,
                             device=device)
    out = decode_attention(q, k_cache, v_cache, ctx, bt, scale, num_splits=num_splits, config=config,
                           order=order, k_scale=k_scale, v_scale=v_scale)
    keep = [i for i, c in enumerate(ctx_lens) if c > 0]
    kr, vr = (k_cache, v_cache) if fp8 else (k_cache.float(), v_cache.float())  # (fp8: dequantized as read)
    ref = paged_attention_torch(q[keep].float(), kr, vr, [1] * len(keep), [ctx_lens[i] for i in keep], bt[keep],
                                scale, k_scale=k_scale, v_scale=v_scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    pad = [i for i, c in enumerate(ctx_lens) if c == 0]
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))  # padded rows: zeros
    return rel_err(out[keep], ref)


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty fills floating tensors with NaN: an output row nobody writes, or a partial the
    split merge reads without its split having written it, shows up (CPU tests)."""
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_filled)


# each way of merging the splits, whatever the group: in the kernel by the last split, or the reduce kernel
MERGES = {"in kernel": {"merge_in_kernel_max_group": 64}, "reduce kernel": {"merge_in_kernel_max_group": 0}}


def counters_are_zero():
    return all(int(c.count_nonzero()) == 0 for c in ta._COUNTERS.counts.values())


def tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]


# ------------------------------------------------------------------------------ CPU (interpreter)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1), (8, 1)])
def test_prefill_gqa_ragged(dtype, heads):
    torch.manual_seed(0)
    q_lens = [5, 37, 1]
    err = run_prefill(q_lens, q_lens, heads[0], heads[1], 16, 16, dtype)
    assert err < tol(dtype), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_cached_prefix_and_chunked(dtype):
    torch.manual_seed(1)
    # seq0: prefix 32 cached + 9 new; seq1: chunk of 20 in the middle of a long prompt (q_len < ctx);
    # seq2: plain prefill; seq3: 1 new token after a 47-token prefix
    q_lens, ctx_lens = [9, 20, 13, 1], [41, 70, 13, 48]
    err = run_prefill(q_lens, ctx_lens, 4, 2, 32, 16, dtype, strided_q=True)
    assert err < tol(dtype), err


@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize("pack_gqa", [True, False])
def test_prefill_packs_a_gqa_group_per_program(heads, pack_gqa):
    """A program may take every query head of a KV head (its rows are (token, head) pairs): ragged
    rows, a cached prefix and a chunk in the middle of a prompt come out as with one head a
    program. (6, 2): a group of 3 is not packed."""
    torch.manual_seed(5)
    cfg = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1, "pack_gqa": pack_gqa}
    group = heads[0] // heads[1]
    assert prefill_heads_per_program(group, 32, pack_gqa) == (group if pack_gqa and group in (2, 4) else 1)
    err = run_prefill([9, 20, 13, 1], [41, 70, 13, 48], heads[0], heads[1], 16, 16, torch.float32,
                      strided_q=True, config=cfg)
    assert err < 1e-5, err


def test_prefill_config_short_rows_only_in_large_steps():
    cuda = torch.device("cuda")  # (only its type is read)
    assert prefill_config(128, cuda, 512, 16384) == SHORT_PREFILL_CFG
    assert prefill_config(128, cuda, 1024, 4096) == SHORT_PREFILL_CFG
    assert prefill_config(128, cuda, 2048, 16384) == PREFILL_CFG  # long rows
    assert prefill_config(128, cuda, 4, 4) == PREFILL_CFG         # a verify step, a graph's mixed step
    assert prefill_config(128, cuda, 512, 2048) == PREFILL_CFG
    assert prefill_config(256, cuda, 512, 16384)["block_m"] == 64  # wide heads: smaller tiles
    assert not PREFILL_CFG["pack_gqa"] and SHORT_PREFILL_CFG["pack_gqa"]


def test_prefill_padded_as_in_a_cuda_graph():
    """As a graph for steps with prompt chunks runs it (engine/graph_runner.py, GraphRunner._replay_mixed): more rows than
    the step's, with no query tokens, padded query tokens past the last row, and max_seqlen_q the
    bucket's. The step's rows come out exactly as without the padding."""
    torch.manual_seed(4)
    block_size, heads, kv_heads, head_dim = 16, 4, 2, 16
    q_lens, ctx_lens = [1, 1, 9, 20], [30, 5, 41, 20]
    n, rows, bucket = sum(q_lens), 8, 64
    num_blocks = sum((c + block_size - 1) // block_size for c in ctx_lens) + 4
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    bt = make_block_tables(ctx_lens, block_size, num_blocks)
    q = torch.randn(bucket, heads, head_dim, device=DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    scale = head_dim ** -0.5
    exact = prefill_attention(q[:n], k_cache, v_cache, cu, ctx, bt, max(q_lens), scale)
    cu_pad = torch.full((rows + 1,), n, dtype=torch.int32, device=DEV)
    cu_pad[:len(cu)] = cu
    ctx_pad = torch.zeros(rows, dtype=torch.int32, device=DEV)
    ctx_pad[:len(ctx_lens)] = ctx
    bt_pad = torch.full((rows, bt.shape[1] + 2), 7, dtype=torch.int32, device=DEV)  # stale entries
    bt_pad[:len(ctx_lens), :bt.shape[1]] = bt
    padded = prefill_attention(q, k_cache, v_cache, cu_pad, ctx_pad, bt_pad, bucket, scale)
    assert torch.equal(padded[:n], exact)


def test_prefill_page_256_and_odd_head_dim():
    torch.manual_seed(2)
    err = run_prefill([30, 7], [300, 7], 4, 2, 16, 256, torch.float32)
    assert err < 1e-5, err
    err = run_prefill([10, 19], [10, 40], 2, 1, 24, 16, torch.float16)  # head_dim 24: padded to 32
    assert err < 2e-3, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1), (8, 1)])
def test_decode_gqa_ragged(dtype, heads):
    torch.manual_seed(3)
    err = run_decode([1, 33, 100, 16], heads[0], heads[1], 16, 16, dtype)
    assert err < tol(dtype), err


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits_and_padding_row(num_splits):
    torch.manual_seed(4)
    # a padding row (context 0, block table all -1) as in a CUDA-graph bucket; a wide block table
    err = run_decode([70, 0, 5, 129], 4, 2, 32, 16, torch.float16, width=12, num_splits=num_splits)
    assert err < 2e-3, err


def test_decode_no_dot_path_and_page_256():
    torch.manual_seed(5)
    err = run_decode([300, 2, 0], 4, 2, 16, 256, torch.float32, config={"dot_min_group": 99})
    assert err < 1e-5, err
    err = run_decode([300, 2, 0], 4, 1, 16, 256, torch.float16, num_splits=4)
    assert err < 2e-3, err
    err = run_decode([45, 17], 2, 1, 24, 16, torch.float16, config={"dot_min_group": 99})
    assert err < 2e-3, err


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_longest_first_order(splits):
    """With an order the programs visit sequences in that order; every row still gets its own output."""
    torch.manual_seed(6)
    err = run_decode([5, 70, 0, 33, 128, 1], 4, 2, 16, 16, torch.float32, num_splits=splits, ordered=True)
    assert err < 1e-5, err


def test_decode_all_padding_rows_writes_zeros():
    q = torch.randn(3, 4, 16, device=DEV)
    k, v = make_cache(4, 16, 2, 16, torch.float32)
    bt = torch.full((3, 4), -1, dtype=torch.int32, device=DEV)
    ctx = torch.zeros(3, dtype=torch.int32, device=DEV)
    for splits in (1, 4):
        out = decode_attention(q, k, v, ctx, bt, 0.25, num_splits=splits)
        assert torch.equal(out, torch.zeros_like(out))


# The split merge: only the splits that own a KV tile run; the last to arrive merges the partials
# (the interpreter runs the programs one after another, so the highest active split merges here).
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("heads,head_dim,dtype", [((1, 1), 128, torch.float32), ((2, 1), 80, torch.float16),
                                                  ((4, 1), 128, torch.float16), ((16, 2), 24, torch.float32)])
def test_decode_many_splits_short_contexts(nan_empty, heads, head_dim, dtype, merge):
    """64 splits over contexts of 1 to 17 tiles: most splits own nothing (they write no partial and
    are never read), a context within one split's share is written directly, 17 active splits take
    two merge rounds. GQA groups 1, 2, 4, 8; head_dim 80 and 24 padded under masks."""
    torch.manual_seed(20)
    err = run_decode([1, 63, 64, 65, 300, 0, 1050], heads[0], heads[1], head_dim, 16, dtype, num_splits=64,
                     ordered=True, config=MERGES[merge])
    assert err < tol(dtype), err
    assert counters_are_zero()


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("num_splits,merge_elems", [(5, 1), (3, 1), (6, 2 * 2 * 32), (8, 4 * 2 * 32)])
def test_decode_uneven_splits_and_merge_rounds(nan_empty, num_splits, merge_elems, merge):
    """Splits that do not divide the tiles (7 tiles over 5 splits: 2, 2, 2, 1 and an empty fifth)
    and merges of 1, 2 and 4 splits a round, so the running max carries across rounds."""
    torch.manual_seed(21)
    cfg = {"block_n": 16, "merge_elems": merge_elems, **MERGES[merge]}
    for fp8 in (False, True):
        err = run_decode([112, 0, 97, 33, 16, 17], 4, 2, 32, 16, torch.float16, num_splits=num_splits,
                         config=cfg, ordered=True, fp8=fp8)
        assert err < 2e-3, (fp8, err)
        assert counters_are_zero()


@pytest.mark.parametrize("merge", MERGES)
def test_decode_split_merge_twice_in_a_row_and_deterministic(nan_empty, merge):
    """Consecutive calls (layers, graph replays) share the arrival counters: every call leaves them
    at zero, so a second call of another shape, and a repeat of the first, come out right; the
    repeat bit for bit."""
    torch.manual_seed(22)
    k, v = make_cache(40, 16, 2, 32, torch.float32)
    ctx_lens = [150, 0, 40, 300]
    bt = make_block_tables(ctx_lens, 16, 40)
    q = torch.randn(4, 8, 32, device=DEV)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    first = decode_attention(q, k, v, ctx, bt, 0.2, num_splits=8, config={"block_n": 32, **MERGES[merge]})
    assert counters_are_zero()
    err = run_decode([70, 130, 5], 6, 3, 16, 16, torch.float32, num_splits=8,
                     config={"block_n": 16, **MERGES[merge]})
    assert err < 1e-5, err
    again = decode_attention(q, k, v, ctx, bt, 0.2, num_splits=8, config={"block_n": 32, **MERGES[merge]})
    assert torch.equal(first, again)
    keep = [0, 2, 3]
    ref = paged_attention_torch(q[keep], k, v, [1] * 3, [ctx_lens[i] for i in keep], bt[keep], 0.2)
    assert rel_err(first[keep], ref) < 1e-5 and torch.equal(first[1], torch.zeros_like(first[1]))


def test_decode_merges_small_groups_in_the_kernel_and_larger_ones_in_the_reduce_kernel(monkeypatch):
    """By default: groups of up to merge_in_kernel_max_group heads count arrivals (the counters
    exist afterwards); larger groups leave that to the reduce kernel."""
    monkeypatch.setattr(ta, "_COUNTERS", ArrivalCounters())
    run_decode([300, 40], 16, 4, 16, 16, torch.float32, num_splits=4)  # a 4-head group
    assert not ta._COUNTERS.counts
    run_decode([300, 40], 8, 4, 16, 16, torch.float32, num_splits=4)  # a 2-head group
    assert ta._COUNTERS.counts and counters_are_zero()


def test_decode_num_splits_nearest_power_of_two_that_fills_the_sms():
    # 132 SMs x 4 programs = 528 programs wanted
    assert decode_num_splits(128, 8, 64, 132) == 1    # 1024 programs already
    assert decode_num_splits(128, 4, 64, 132) == 2    # one rank of tp=2: 512 -> 1024
    assert decode_num_splits(64, 4, 64, 132) == 4     # wants 3 (2.06): 4
    assert decode_num_splits(16, 8, 64, 132) == 4     # wants 5: 4, not 8
    assert decode_num_splits(6, 8, 64, 132) == 8      # wants 11: 8, not 16
    assert decode_num_splits(1, 8, 64, 132) == 64     # capped by max_splits
    assert decode_num_splits(1, 8, 5, 132) == 8       # and by the tiles (rounded up to a power of two)
    assert decode_num_splits(0, 8, 64, 132) == 64     # an empty batch never divides by zero


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("heads,head_dim,block_size", [((16, 8), 128, 256), ((32, 8), 128, 16),
                                                       ((16, 16), 64, 256), ((28, 4), 128, 256),
                                                       ((8, 8), 80, 256)])
def test_cuda_prefill(heads, head_dim, block_size):
    torch.manual_seed(10)
    q_lens = [1000, 1, 257, 64, 2048]
    ctx_lens = [1000, 300, 257, 1500, 2048]  # cached prefix / chunked rows included
    err = run_prefill(q_lens, ctx_lens, heads[0], heads[1], head_dim, block_size, torch.bfloat16,
                      strided_q=True)
    assert err < 1.5e-2, err
    err = run_prefill([333, 129], [900, 129], heads[0], heads[1], head_dim, block_size, torch.float16)
    assert err < 2e-3, err
    # a large step of short rows (SHORT_PREFILL_CFG: a GQA group a program), prefixes included
    q_lens = [1000, 1, 700, 64, 1024, 900, 513, 100]
    err = run_prefill(q_lens, [1000, 300, 1500, 64, 1024, 900, 2000, 100], heads[0], heads[1], head_dim,
                      block_size, torch.bfloat16, strided_q=True)
    assert err < 1.5e-2, err


@pytest.mark.cuda
@pytest.mark.parametrize("heads,head_dim,block_size", [((16, 8), 128, 256), ((32, 8), 128, 16),
                                                       ((16, 16), 64, 256), ((32, 4), 128, 256),
                                                       ((8, 8), 80, 256)])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_cuda_decode(heads, head_dim, block_size, batch):
    torch.manual_seed(11)
    rng = random.Random(batch)
    ctx_lens = [rng.randint(1, 3000) for _ in range(batch)]
    if batch > 1:
        ctx_lens[1] = 0  # padding row
    width = math.ceil(4096 / block_size)
    err = run_decode(ctx_lens, heads[0], heads[1], head_dim, block_size, torch.bfloat16, width=width)
    assert err < 1.5e-2, err


@pytest.mark.cuda
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 8), 128), ((8, 8), 80), ((64, 8), 128)])
def test_cuda_decode_split_merge_short_contexts(heads, head_dim):
    """Batch 1-4 with short contexts, as the engine at low batch: up to 64 splits, most empty; the
    merging split is whichever arrives last, so repeats must still agree bit for bit."""
    torch.manual_seed(13)
    for ctx_lens in ([1], [300], [63, 64, 65, 0], [700, 1, 129], [4000]):
        for splits in (None, 64, 5):
            err = run_decode(ctx_lens, heads[0], heads[1], head_dim, 16, torch.bfloat16, width=256,
                             num_splits=splits, ordered=True)
            assert err < 1.5e-2, (ctx_lens, splits, err)
    k, v = make_cache(80, 16, heads[1], head_dim, torch.bfloat16)
    ctx_lens = [900, 17, 300]
    bt = make_block_tables(ctx_lens, 16, 80)
    q = torch.randn(3, heads[0], head_dim, dtype=torch.bfloat16, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    outs = [decode_attention(q, k, v, ctx, bt, head_dim ** -0.5, num_splits=64) for _ in range(20)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.cuda.synchronize()
    assert counters_are_zero()


@pytest.mark.cuda
def test_cuda_decode_counters_not_grown_in_a_capture(monkeypatch):
    monkeypatch.setattr(ta, "_COUNTERS", ArrivalCounters())
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        with torch.cuda.graph(g):
            ta._arrival_counts(torch.device("cuda", torch.cuda.current_device()), 16)


@pytest.mark.cuda
def test_cuda_decode_graph_capture():
    torch.manual_seed(12)
    B, H, KVH, D, BS = 16, 16, 8, 128, 256
    k, v = make_cache(160, BS, KVH, D, torch.bfloat16)
    rng = random.Random(0)
    ctx_lens = [rng.randint(1, 2000) for _ in range(B)]
    ctx_lens[3] = 0  # padding row
    bt = make_block_tables(ctx_lens, BS, 160, width=16)
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    decode_attention(q, k, v, ctx, bt, D ** -0.5)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode_attention(q, k, v, ctx, bt, D ** -0.5)
    for step in range(3):  # replays with other contexts: the counters were left at zero
        q.copy_(torch.randn_like(q))
        if step:
            ctx_lens = [max(1, c - 97 * step) if c else 0 for c in ctx_lens]
            ctx.copy_(torch.tensor(ctx_lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        keep = [i for i in range(B) if ctx_lens[i] > 0]
        ref = paged_attention_torch(q[keep].float(), k.float(), v.float(), [1] * len(keep),
                                    [ctx_lens[i] for i in keep], bt[keep], D ** -0.5)
        assert torch.isfinite(out).all() and rel_err(out[keep], ref) < 1.5e-2
        assert torch.equal(out[3], torch.zeros_like(out[3])) and counters_are_zero()


# ------------------------------------------------------------- batch-invariant use (both devices)
def _invariant_config(pack: bool) -> dict:
    return {"block_m": 16 if DEV == "cpu" else 64, "block_n": 32, "num_warps": 4,
            "num_stages": 1 if DEV == "cpu" else 3, "pack_gqa": pack, "mask_every_tile": True}


@pytest.mark.parametrize("heads,pack", [((4, 2), True), ((4, 4), False)])
def test_prefill_one_query_rows_and_chunks_equal_whole_prompt_rows_bitwise(heads, pack):
    """cu_seqlens_q=None (decode rows) and prompt chunks after a cached prefix give a position the
    bits its row of the whole prompt gets, with every key tile masked alike (mask_every_tile);
    the whole prompts against the torch reference."""
    torch.manual_seed(5)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    ctx = [70, 101, 40, 133]
    config = _invariant_config(pack)
    assert run_prefill(ctx, ctx, heads[0], heads[1], 32, 16, dtype, config=config) < tol(dtype)
    k_cache, v_cache = make_cache(64, 16, heads[1], 32, dtype)
    tables = make_block_tables(ctx, 16, 64)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(ctx), heads[0], 32, dtype=dtype, device=DEV)
    ends = torch.tensor(ctx, device=DEV).cumsum(0)
    cu = torch.cat([torch.zeros(1, device=DEV), ends]).to(torch.int32)
    full = prefill_attention(q, k_cache, v_cache, cu, context_lens, tables, max(ctx), 0.3, config=config)
    last = (ends - 1).long()
    one = prefill_attention(q[last].contiguous(), k_cache, v_cache, None, context_lens, tables, 1, 0.3,
                            config=config)
    rows = torch.cat([torch.arange(int(e) - 37, int(e), device=DEV) for e in ends])
    cu37 = (torch.arange(len(ctx) + 1, device=DEV) * 37).to(torch.int32)
    chunk = prefill_attention(q[rows].contiguous(), k_cache, v_cache, cu37, context_lens, tables, 37, 0.3,
                              config=config)
    assert torch.equal(one, full[last]) and torch.equal(chunk, full[rows])
