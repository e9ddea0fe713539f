"""Paged attention in Triton: prefill (tiled flash-attention forward) and decode (flash-decoding).

Cache layout per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] (last dim
contiguous); block_tables [num_seqs, width] int32 maps a sequence's logical block j to a physical
block (-1 beyond the used blocks, never read). Token p of a sequence lives in physical block
block_tables[i, p // block_size], row p % block_size. Both kernels look the physical block up per
token row of a KV tile (one small gather that stays in L1/L2), so a tile may span several pages
(block_size 16) or part of one (256).

Common to both: row offsets are int64; a head's head_dim values are contiguous, so K/V loads are
16-byte vectors (the strides get Triton's divisible-by-16 specialisation). A head_dim that is not a
power of two (80, 96, 24, ...) is padded to the next one (at least 16, for tl.dot) under a mask,
which is compiled out when head_dim is a power of two. The softmax runs in the exp2 domain (scale *
log2 e folded into one multiply). Integer arguments that change from step to step are never
specialised on, which would JIT-compile a new variant in the middle of serving.

Decode: grid (num_kv_heads, num_splits, num_seqs). A program streams one split of one sequence's KV
for one KV head and serves every query head of that KV head with tl.dot (GQA: K/V are read once per
group; the query rows are padded to 16). The dot path serves every group size, one included:
the elementwise path (`dot_min_group` above 1) was several times slower on the GPU. The number of
splits comes from shapes only (CUDA-graph safe: no host sync, the partials' workspace from
torch.empty); each sequence's context is divided evenly among the splits at run time, so short
contexts in a wide captured block table still spread over the splits. With one split the kernel
normalises and writes the output. With more, each stores float32 (o, lse) partials, merged one of
two ways. For small GQA groups (`merge_in_kernel_max_group`) in the kernel: only the splits that own
a KV tile run (the others return at once), each counts its arrival on the (sequence, KV head)'s
counter, and the split that arrives last merges the partials in split order (the result does not
depend on timing), writes the output and resets the counter to zero: no second kernel on the
critical path (nanoinfer/kernels/skinny_gemm.py's split-K does the same); a sequence whose context
fits one split's share writes its output directly. For larger groups a small kernel (grid num_seqs
x num_heads) merges them, a head a program. A row with context length 0 (a padded row) gets zeros.

An optional `order` (sequence indices, longest context first) makes the GPU start the longest
programs first (programs are dispatched roughly in grid order). An engine step's contexts are
ragged, and with the sequences in batch order the last wave of programs held a few long ones
while the other SMs idled; more splits shortened that tail but cost at full batch. Longest first,
the tail is short programs, and the split count can aim at a few programs per SM.

Prefill (also every step with prompt chunks, decode rows included): grid (num_heads, num_seqs,
query tiles). The heaviest (latest) query tile is scheduled first, and the heads vary fastest, so
the heads that share a KV head run together and reuse it from L2. Sequence i's query rows are the
last q_len of its context_len positions, which covers plain prefill, a cached prefix and chunked
prefill alike. Two loops: the key tiles wholly below the tile's first query position (no masks at
all), then the diagonal tiles (causal and length masks). q may be a strided view (of a fused qkv).
Batch-invariant attention (nanoinfer/batch_invariant) is this kernel with one config for every step:
`mask_every_tile` sends every key tile through the masked loop (the two loops round differently on
the GPU: a prompt chunk's rows, whose tiles split the loops elsewhere, differed from the whole
prompt's), and cu_seqlens_q=None runs a decode step as one-query rows. A row's result then depends
only on its sequence: key tiles at absolute positions, in order, the same dots whatever rows share
its tile.

FP8 cache (float8_e4m3fn k_cache/v_cache, kv_cache_dtype="fp8"): the kernels load the fp8 tiles,
widen them in registers to float16 (exact: every e4m3 value is a float16 value; one instruction
for two, where bf16 takes two more a value and left the kernels convert-bound) and fold the layer's
scales in where they cost one multiply: k_scale into the softmax scale, v_scale into the output.
The dots run in float16: q is converted to it (exact for a bf16 q within float16's range, to which
it is clamped), and so is P. A float32 model keeps float32 throughout. No fp8 dot. Decode over an
FP8 cache uses DECODE_FP8_CFG's pipeline depth.

Tile configs (DECODE_CFG, PREFILL_CFG) are the best of nanoinfer/bench/kernels.py --sweep on an
H200: for decode BLOCK_N 64 with 2-4 warps and 3-4 stages (32 or 256 lost); for prefill (128, 128)
tiles, 8 warps, 3 stages, one head a program, except in large steps of short rows: (128, 32)
tiles, 4 warps, a GQA group a program (SHORT_PREFILL_CFG). Not tried yet: more splits than
max_splits, or BLOCK_N 128, for a single long sequence (the decode case furthest below the copy
bandwidth).
"""

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.arrival_counters import ArrivalCounters
from nanoinfer.kernels.kv_store import is_fp8_cache, scale_or_unit
from nanoinfer.kernels.pdl import pdl_options

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_offsets(bt_ptr, pos, n_mask, BLOCK_SIZE: tl.constexpr, stride_kb, stride_kt):
    """Element offset of each token row `pos` (without head/dim offsets) through the block table."""
    phys = tl.load(bt_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return phys * stride_kb + (pos % BLOCK_SIZE) * stride_kt


@triton.jit
def _q_for_fp8_cache(q, FP32: tl.constexpr):
    """q for the dots with an FP8 cache's tiles, which widen to float16 (see the module's doc):
    float16, clamped to its range (float32 for a float32 model)."""
    if not FP32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


# --------------------------------------------------------------------------------------- decode
@triton.jit(do_not_specialize=["stride_btb"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, order_ptr, out_ptr, po_ptr, plse_ptr, count_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                   stride_ob, stride_oh, qk_scale, k_scale_ptr, v_scale_ptr,
                   NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, FP32: tl.constexpr,
                   HAS_ORDER: tl.constexpr, KV_FP8: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr,
                   MERGE_G: tl.constexpr, MERGE_SPLITS: tl.constexpr, PDL: tl.constexpr):
    kvh = tl.program_id(0)
    if PDL:  # (kernels/pdl.py) q and the newest K/V come from the kernel before
        tl.extra.cuda.gdc_wait()
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if HAS_ORDER:
        seq = tl.load(order_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    # merged here: only the splits that own a tile run (split 0 of an empty row writes zeros); the
    # reduce kernel instead reads every split's partials, empty ones included
    n_active = tl.cdiv(n_tiles, tl.maximum(per_split, 1))
    if NUM_SPLITS > 1 and MERGE_IN_KERNEL:
        if split >= tl.maximum(n_active, 1):
            return
    t_start = split * per_split
    t_end = tl.minimum(t_start + per_split, n_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    if D_PAD == HEAD_DIM:
        q_mask = g_mask[:, None]
    else:
        q_mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if KV_FP8:
        q = _q_for_fp8_cache(q, FP32)
    if not USE_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    kv_head = kvh * stride_kh
    for t in range(t_start, t_end):
        pos = t * BLOCK_N + offs_n
        n_mask = pos < ctx
        off = _kv_offsets(bt_row, pos, n_mask, BLOCK_SIZE, stride_kb, stride_kt) + kv_head
        if D_PAD == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        kv_off = off[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if USE_DOT:
            if FP32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_DOT:
            if FP32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # partials: po [B, H, NUM_SPLITS, D_PAD] fp32, plse [B, H, NUM_SPLITS] (log2 domain)
    head_rows = (seq.to(tl.int64) * (tl.num_programs(0) * GROUP) + kvh * GROUP) * NUM_SPLITS
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if NUM_SPLITS == 1:
        _store_out(out_ptr, seq, heads, offs_d, g_mask, o, stride_ob, stride_oh, HEAD_DIM, D_PAD)
    elif not MERGE_IN_KERNEL:  # the reduce kernel merges them
        _store_partials(po_ptr, plse_ptr, head_rows + offs_g * NUM_SPLITS + split, offs_d, g_mask, o, lse, D_PAD)
    elif n_active <= 1:  # one split holds the whole context (or none does: a padded row's zeros)
        _store_out(out_ptr, seq, heads, offs_d, g_mask, o, stride_ob, stride_oh, HEAD_DIM, D_PAD)
    else:
        _store_partials(po_ptr, plse_ptr, head_rows + offs_g * NUM_SPLITS + split, offs_d, g_mask, o, lse, D_PAD)
        # count the arrivals of this (sequence, KV head)'s active splits: the last one merges
        tl.debug_barrier()  # every thread's partials are written before the arrival is counted
        count = count_ptr + seq * tl.num_programs(0) + kvh
        arrived = tl.atomic_add(count, 1, sem="acq_rel")
        if arrived == n_active - 1:
            tl.debug_barrier()  # the other threads read the partials after the acquiring atomic
            merged = _merge_splits(po_ptr, plse_ptr, head_rows, n_active, offs_d, NUM_SPLITS, GROUP, D_PAD,
                                   MERGE_G, MERGE_SPLITS)
            offs_h = tl.arange(0, MERGE_G)
            _store_out(out_ptr, seq, kvh * GROUP + offs_h, offs_d, offs_h < GROUP, merged, stride_ob, stride_oh,
                       HEAD_DIM, D_PAD)
            tl.atomic_xchg(count, 0)  # zero again for the next call (the next layer, a graph replay)


@triton.jit
def _store_partials(po_ptr, plse_ptr, row, offs_d, g_mask, o, lse, D_PAD: tl.constexpr):
    tl.store(po_ptr + row[:, None] * D_PAD + offs_d[None, :], o, mask=g_mask[:, None])
    tl.store(plse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(po_ptr, plse_ptr, out_ptr, stride_ob, stride_oh,
                          NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          D_PAD: tl.constexpr, PDL: tl.constexpr):
    seq = tl.program_id(0)
    if PDL:  # (kernels/pdl.py) the partials come from the decode kernel
        tl.extra.cuda.gdc_wait()
    h = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + h
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(plse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    valid = lse > float("-inf")
    w = tl.where(valid, tl.exp2(lse - tl.where(valid, m, 0.0)), 0.0)
    po = tl.load(po_ptr + (row * NUM_SPLITS + offs_s)[:, None] * D_PAD + offs_d[None, :],
                 mask=s_mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    o = tl.sum(w[:, None] * po, 0) / tl.where(denom > 0, denom, 1.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _store_out(out_ptr, seq, heads, offs_d, h_mask, o, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr):
    if D_PAD == HEAD_DIM:
        o_mask = h_mask[:, None]
    else:
        o_mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_splits(po_ptr, plse_ptr, head_rows, n_active, offs_d, NUM_SPLITS: tl.constexpr,
                  GROUP: tl.constexpr, D_PAD: tl.constexpr, MERGE_G: tl.constexpr,
                  MERGE_SPLITS: tl.constexpr):
    """The normalised output [MERGE_G, D_PAD] of a KV head's query heads from the partials of its
    first n_active splits. MERGE_SPLITS splits a round (one load of them all: a round trip to L2
    each), merged in split order with a running max, so the result does not depend on which split
    arrived last. .cg loads: other programs' partials, never a stale L1 line."""
    offs_c = tl.arange(0, MERGE_SPLITS)
    offs_h = tl.arange(0, MERGE_G)
    h_rows = head_rows + offs_h * NUM_SPLITS
    h_mask = offs_h < GROUP
    m = tl.full([MERGE_G], float("-inf"), tl.float32)
    l = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, D_PAD], tl.float32)
    for c0 in range(0, n_active, MERGE_SPLITS):
        s = c0 + offs_c
        rows = s[:, None] + h_rows[None, :]  # [MERGE_SPLITS, MERGE_G]
        mask = (s < n_active)[:, None] & h_mask[None, :]
        lse = tl.load(plse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        po = tl.load(po_ptr + rows[:, :, None] * D_PAD + offs_d[None, None, :], mask=mask[:, :, None],
                     other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # (no -inf - -inf)
        w = tl.exp2(lse - m_ref[None, :])
        alpha = tl.exp2(m - m_ref)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * po, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    return acc / tl.where(l > 0, l, 1.0)[:, None]


_NUM_SMS = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


# Tunables (nanoinfer/bench/kernels.py sweeps them); programs per SM the split heuristic aims for.
# 4, from the --ragged sweep on an H200 (8 and 4 KV heads: one rank of an 8B model at tp=1 and 2):
# even with longest-first ordering, ragged steps gained from splitting to about two waves of programs.
# merge_elems: float32 partials the merging split loads a round (splits x heads x padded head_dim),
# at most 16 splits a round: it bounds the round's registers.
# merge_in_kernel_max_group: the largest GQA group whose splits the last split merges; larger
# groups keep the reduce kernel, which spreads the heads over programs (with a 4-head group, the
# 8B shape, the in-kernel merge made the batch-1 step slower; with 2 heads, 0.6B, faster).
DECODE_CFG = {"block_n": 64, "num_warps": 2, "num_stages": 3, "programs_per_sm": 4,
              "max_splits": 64, "dot_min_group": 1, "merge_elems": 8192,
              "merge_in_kernel_max_group": 2}
# over an FP8 cache (half the bytes a tile, more conversion work a byte) two stages beat three
DECODE_FP8_CFG = {"num_stages": 2}


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


# The split merge's arrival counters, one per (sequence, KV head) (kernels/arrival_counters.py).
# Grown outside CUDA-graph capture only: a buffer made during a capture would not be zeroed until
# the graph first replays.
_COUNTERS = ArrivalCounters()


def _arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    if not _COUNTERS.fits(device, n) and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"decode_attention: its split-merge counters ({n} needed) must be allocated before "
                           "CUDA-graph capture: run the same call once outside the capture first")
    return _COUNTERS.get(device, n)


def decode_num_splits(batch: int, num_kv_heads: int, max_tiles: int, num_sms: int,
                      programs_per_sm: int | None = None, max_splits: int | None = None) -> int:
    """Splits per (sequence, KV head) from shapes only: the power of two nearest the count that
    fills the SMs with programs_per_sm programs each (rounding 5 up to 8 was no faster than 4, and
    each split adds partials to merge). Ragged batches need no more than that once the programs
    run longest first (nanoinfer/bench/kernels.py --ragged)."""
    programs_per_sm = programs_per_sm or DECODE_CFG["programs_per_sm"]
    max_splits = max_splits or DECODE_CFG["max_splits"]
    want = triton.cdiv(num_sms * programs_per_sm, max(batch * num_kv_heads, 1))
    splits = triton.next_power_of_2(want)
    if 4 * want < 3 * splits:  # nearer the power of two below
        splits //= 2
    splits = min(splits, max_splits, triton.next_power_of_2(max(max_tiles, 1)))
    return max(splits, 1)


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale: float,
                     num_splits: int | None = None, config: dict | None = None,
                     order: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, num_heads, head_dim] (last dim contiguous); one query per sequence at position
    context_lens[i] - 1. order: None, or a permutation of range(B) (int32), longest context first.
    k_scale, v_scale: float32 scalar tensors, read for an FP8 cache only (None: 1.0).
    Returns [B, num_heads, head_dim] contiguous. No host syncs: CUDA-graph safe."""
    cfg = dict(DECODE_CFG, **(DECODE_FP8_CFG if is_fp8_cache(k_cache) else {}), **(config or {}))
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_dim))
    use_dot = group >= cfg["dot_min_group"]
    group_pad = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    block_n = min(cfg["block_n"], triton.next_power_of_2(block_tables.shape[1] * block_size))
    block_n = max(block_n, 16)
    max_tiles = triton.cdiv(block_tables.shape[1] * block_size, block_n)
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_tiles, _num_sms(q.device),
                                       cfg["programs_per_sm"], cfg["max_splits"])
    merge_g = triton.next_power_of_2(group)
    merge_splits = min(16, triton.next_power_of_2(num_splits), _floor_pow2(cfg["merge_elems"] // (merge_g * d_pad)))
    merge_in_kernel = group <= cfg["merge_in_kernel_max_group"]
    po = plse = counts = out  # (unused with one split)
    if num_splits > 1:
        po = torch.empty((batch, num_heads, num_splits, d_pad), dtype=torch.float32, device=q.device)
        plse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        if merge_in_kernel:
            counts = _arrival_counts(q.device, batch * num_kv_heads)
    _decode_kernel[(num_kv_heads, num_splits, batch)](
        q, k_cache, v_cache, block_tables, context_lens, context_lens if order is None else order, out, po, plse,
        counts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * _LOG2E,
        scale_or_unit(k_scale, q.device), scale_or_unit(v_scale, q.device),
        NUM_SPLITS=num_splits, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, USE_DOT=use_dot, FP32=q.dtype == torch.float32,
        HAS_ORDER=order is not None, KV_FP8=is_fp8_cache(k_cache), MERGE_IN_KERNEL=merge_in_kernel,
        MERGE_G=merge_g, MERGE_SPLITS=merge_splits, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_options(q.device))
    if num_splits > 1 and not merge_in_kernel:
        _decode_reduce_kernel[(batch, num_heads)](
            po, plse, out, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            S_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, D_PAD=d_pad, num_warps=4,
            **pdl_options(q.device))
    return out


# -------------------------------------------------------------------------------------- prefill
# Integer arguments that change from step to step are not specialised on (==1, %16).
@triton.jit(do_not_specialize=["stride_btb"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                    stride_ot, stride_oh, qk_scale, k_scale_ptr, v_scale_ptr,
                    GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    FP32: tl.constexpr, KV_FP8: tl.constexpr, ONE_QUERY: tl.constexpr,
                    MASK_EVERY_TILE: tl.constexpr):
    # A program takes PACK query heads that share one KV head (PACK = 1 or GROUP) over TOK query
    # tokens: its BLOCK_M rows are (token, head) pairs, token-major, so each K/V tile it loads
    # serves every head of the group.
    TOK: tl.constexpr = BLOCK_M // PACK
    head_group = tl.program_id(0)
    seq = tl.program_id(1)
    m_tile = tl.num_programs(2) - 1 - tl.program_id(2)  # heaviest (latest) query tiles first
    if ONE_QUERY:  # a decode step: query row i is sequence i's last position
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
    if m_tile * TOK >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len
    kvh = head_group * PACK // GROUP
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m_tile * TOK + offs_r // PACK        # each row's query token
    heads = head_group * PACK + offs_r % PACK     # and head
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    if D_PAD == HEAD_DIM:
        q_mask = m_mask[:, None]
    else:
        q_mask = m_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask,
                other=0.0)
    if KV_FP8:
        q = _q_for_fp8_cache(q, FP32)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    kv_head = kvh * stride_kh

    first_q = prefix + m_tile * TOK
    full_end = (first_q // BLOCK_N) * BLOCK_N           # keys below: visible to every row, all < ctx
    if MASK_EVERY_TILE:  # one code path for every tile: a row's arithmetic then never depends on its tile
        full_end = 0
    hi = tl.minimum(ctx, first_q + TOK)                # keys at or past hi: visible to no row

    # phase 1: fully visible key tiles, no masks
    for start in range(0, full_end, BLOCK_N):
        pos = start + offs_n
        off = _kv_offsets(bt_row, pos, pos < ctx, BLOCK_SIZE, stride_kb, stride_kt) + kv_head
        kv_off = off[:, None] + offs_d[None, :]
        if D_PAD == HEAD_DIM:
            k = tl.load(k_ptr + kv_off)
            v = tl.load(v_ptr + kv_off)
        else:
            d_mask = offs_d[None, :] < HEAD_DIM
            k = tl.load(k_ptr + kv_off, mask=d_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=d_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # phase 2: the diagonal tiles, causal mask
    for start in range(full_end, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < ctx
        off = _kv_offsets(bt_row, pos, n_mask, BLOCK_SIZE, stride_kb, stride_kt) + kv_head
        kv_off = off[:, None] + offs_d[None, :]
        if D_PAD == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


PREFILL_CFG = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "pack_gqa": False}
# Large steps (at least SHORT_PREFILL_MIN_TOKENS query tokens) whose rows are at most
# SHORT_PREFILL_MAX_Q tokens: each program sees few key tiles, so narrow key tiles (less of the
# diagonal tile masked away) and a whole GQA group per program (fewer programs, each K/V tile
# loaded once for the group) win; long rows favour PREFILL_CFG. Small steps (a speculative verify,
# the CUDA graphs' mixed steps, whose decode rows attend to long contexts one query at a time)
# keep PREFILL_CFG: fewer, wider key tiles a program.
SHORT_PREFILL_CFG = {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3, "pack_gqa": True}
SHORT_PREFILL_MAX_Q = 1024
SHORT_PREFILL_MIN_TOKENS = 4096


def prefill_config(head_dim: int, device: torch.device, max_seqlen_q: int, total_q: int) -> dict:
    """The prefill kernel's tiles for a step of `total_q` query tokens, rows of at most max_seqlen_q."""
    if device.type != "cuda":  # interpreter: small tiles keep CPU tests quick
        return {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 1, "pack_gqa": True}
    if head_dim > 128:
        return dict(PREFILL_CFG, block_m=64, block_n=32, num_stages=2)
    short = max_seqlen_q <= SHORT_PREFILL_MAX_Q and total_q >= SHORT_PREFILL_MIN_TOKENS
    return dict(SHORT_PREFILL_CFG if short else PREFILL_CFG)


def prefill_heads_per_program(group: int, block_m: int, pack_gqa: bool) -> int:
    """The query heads a prefill program takes: the whole GQA group (its K/V loaded once for all)
    when the group is a power of two that leaves at least 8 tokens a tile, else one."""
    if pack_gqa and group > 1 and group & (group - 1) == 0 and block_m // group >= 8:
        return group
    return 1


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                      max_seqlen_q: int, scale: float, config: dict | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [total_q, num_heads, head_dim] (last dim contiguous; may be a strided view). Sequence i owns
    rows cu_seqlens_q[i]:cu_seqlens_q[i+1], the last q_len_i of its context_lens[i] positions (their
    K/V already stored). Causal. cu_seqlens_q None: one query a sequence (a decode step; row i at
    position context_lens[i] - 1), computed as the same row of a prompt would be. k_scale, v_scale:
    float32 scalar tensors, read for an FP8 cache only (None: 1.0). Returns [total_q, num_heads,
    head_dim] contiguous."""
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    batch = total_q if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    cfg = dict(prefill_config(head_dim, q.device, max_seqlen_q, total_q), **(config or {}))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    group = num_heads // num_kv_heads
    pack = prefill_heads_per_program(group, block_m, cfg["pack_gqa"])
    grid = (num_heads // pack, batch, triton.cdiv(max_seqlen_q, block_m // pack))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens if cu_seqlens_q is None else cu_seqlens_q,  # (unread if None)
        context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * _LOG2E,
        scale_or_unit(k_scale, q.device), scale_or_unit(v_scale, q.device),
        GROUP=group, PACK=pack, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, FP32=q.dtype == torch.float32, KV_FP8=is_fp8_cache(k_cache),
        ONE_QUERY=cu_seqlens_q is None, MASK_EVERY_TILE=cfg.get("mask_every_tile", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
