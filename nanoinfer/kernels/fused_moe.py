"""Fused mixture-of-experts in Triton (CUDA; the interpreter on CPU for tests), in the spirit of
vLLM's fused_moe: tokens grouped by expert, then each projection is one grouped GEMM over all experts.

1. moe_align (three small kernels): the M*top_k (token, slot) pairs, numbered t * top_k + k, are
   sorted by expert into `sorted_ids`, each expert's segment padded to a multiple of BLOCK_M with a
   sentinel (M * top_k), so a BLOCK_M row block belongs to one expert (`block_expert`). The order
   inside an expert is the pairs' order (stable, deterministic). Pairs of expert id -1 (expert
   parallel: another rank's expert) are in no segment.
2. gate_up: for each row block and BLOCK_N intermediate columns, x[token] @ W13[e]^T for the gate and
   the up half at once, silu(gate) * up in registers, written to row t * top_k + k of `act`.
3. down: act rows @ W2[e]^T, times the routing weight, written to row t * top_k + k of `out_k`.
4. the top_k rows of each token are summed (accumulated in float32).

CUDA-graph safe: every grid and buffer size comes from M, top_k, E and the weight shapes. The real
number of padded rows stays on the device (`num_padded`): programs past it return at once. No kernel
is specialised on M (a per-step integer); the tile sizes come in three sets chosen by M
(`default_config`), all compiled at start-up on CUDA (the warm-up forward and the graph captures).

Each row's result depends on that row alone, so the sorting and padding (BLOCK_M) never change it;
BLOCK_K sets the accumulation order. Partial sums stay in float32 until the final rounding.
The torch reference is layers/fused_moe.py `fused_moe_torch`.

FP8 experts (weight-only): the weight tiles are float8_e4m3fn, widened to the activations' dtype in
registers, each tile's product scaled by its K group's scale per output feature (block scales), or
the finished sums by the row's scale (per channel / per tensor): half the weight bytes of bf16.
"""
import torch
import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------ align
@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pairs per expert in each chunk of BLOCK_T pairs: chunk_counts[chunk, e]."""
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    experts = tl.arange(0, E_PAD)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(chunk_counts_ptr + chunk * E_PAD + experts, tl.sum(hits, 0))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _offsets_kernel(chunk_counts_ptr, chunk_offsets_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                    num_pairs, num_chunks, max_blocks, E: tl.constexpr, E_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, C_TILE: tl.constexpr, B_TILE: tl.constexpr):
    """One program: expert segment starts, each chunk's first slot per expert, the sentinel in each
    segment's padding, the expert of every row block, and the padded total."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, C_TILE):
        rows = c0 + tl.arange(0, C_TILE)
        tile = tl.load(chunk_counts_ptr + rows[:, None] * E_PAD + experts[None, :],
                       mask=rows[:, None] < num_chunks, other=0)
        counts += tl.sum(tile, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, 0))

    carry = starts
    for c0 in range(0, num_chunks, C_TILE):
        rows = c0 + tl.arange(0, C_TILE)
        mask = rows[:, None] < num_chunks
        tile = tl.load(chunk_counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=mask, other=0)
        before = tl.cumsum(tile, 0) - tile  # pairs of this expert in earlier chunks of the tile
        tl.store(chunk_offsets_ptr + rows[:, None] * E_PAD + experts[None, :], carry[None, :] + before, mask=mask)
        carry += tl.sum(tile, 0)

    pad = tl.arange(0, BLOCK_M)
    pad_pos = (starts + counts)[:, None] + pad[None, :]
    tl.store(sorted_ptr + pad_pos, tl.zeros([E_PAD, BLOCK_M], tl.int32) + num_pairs, mask=pad_pos < ends[:, None])

    for b0 in range(0, max_blocks, B_TILE):
        blocks = b0 + tl.arange(0, B_TILE)
        # a block's expert: how many segments end at or before its first row (empty ones included)
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, E - 1), mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(ids_ptr, chunk_offsets_ptr, sorted_ptr, num_pairs, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each pair to its slot: its chunk's first slot for its expert + same-expert pairs before it."""
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
    experts = tl.arange(0, E_PAD)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.sum(hits * (tl.cumsum(hits, 0) - hits), 1)
    base = tl.sum(hits * tl.load(chunk_offsets_ptr + chunk * E_PAD + experts)[None, :], 1)
    tl.store(sorted_ptr + base + rank, offs, mask=valid & (ids >= 0))  # (id -1: a skipped pair, in no segment)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded pair count: at most min(E, pairs) segments, each padded by < BLOCK_M."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [M, top_k] -> (sorted_ids [P] int32, block_expert [P / block_m] int32, num_padded [1]
    int32), P = max_padded_rows rounded up to block_m. Slots past num_padded are never read."""
    num_pairs = topk_ids.numel()
    e_pad = triton.next_power_of_2(num_experts)
    block_t = max(16, min(256, 8192 // e_pad))  # one [BLOCK_T, E_PAD] one-hot tile per program
    num_chunks = triton.cdiv(num_pairs, block_t)
    max_blocks = triton.cdiv(max_padded_rows(num_pairs, num_experts, block_m), block_m)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    chunk_counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=dev)
    chunk_offsets = torch.empty_like(chunk_counts)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _count_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, E_PAD=e_pad, BLOCK_T=block_t)
    _offsets_kernel[(1,)](chunk_counts, chunk_offsets, sorted_ids, block_expert, num_padded, num_pairs, num_chunks,
                          max_blocks, E=num_experts, E_PAD=e_pad, BLOCK_M=block_m,
                          C_TILE=max(1, min(64, 4096 // e_pad)), B_TILE=max(1, min(128, 8192 // e_pad)))
    _scatter_kernel[(num_chunks,)](ids, chunk_offsets, sorted_ids, num_pairs, E_PAD=e_pad, BLOCK_T=block_t)
    return sorted_ids, block_expert, num_padded


# ------------------------------------------------------------------------------------------ GEMMs
@triton.jit
def _dot(a, b, acc, FP32: tl.constexpr):
    if FP32:  # no TF32: float32 must match the torch path
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _scaled_dot(a, w, acc, s_ptr, k0, KB: tl.constexpr, GROUP_K: tl.constexpr, FP8: tl.constexpr,
                FP32: tl.constexpr):
    """acc + a @ w. FP8 weights are widened to a's dtype; with block scales (KB > 1) the tile's
    product is scaled by its K group's scale of each column (s_ptr: [BLOCK_N] pointers to the
    columns' scale rows); with one scale column the caller scales the finished sum."""
    if not FP8:
        return _dot(a, w, acc, FP32)
    w = w.to(a.dtype)
    if KB == 1:
        return _dot(a, w, acc, FP32)
    s = tl.load(s_ptr + k0 // GROUP_K)
    return acc + _dot(a, w, tl.zeros_like(acc), FP32) * s[None, :]


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, N, K,
                    stride_xm, stride_we, stride_wn, stride_am, s_ptr, stride_se, stride_sn,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP32: tl.constexpr, FP8: tl.constexpr, KB: tl.constexpr, GROUP_K: tl.constexpr):
    """act[pair, n] = silu(x[token] . W13[e, n]) * (x[token] . W13[e, N + n]) for one row block.
    FP8: W13 float8 with float32 scales [E, 2N, KB], one row per output feature."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    # (FP8) each column's scale row; masked columns read row 0
    sg_ptrs = s_ptr + expert * stride_se + tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_sn
    su_ptrs = sg_ptrs + N * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = _scaled_dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), gate, sg_ptrs, k0, KB, GROUP_K, FP8, FP32)
        up = _scaled_dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), up, su_ptrs, k0, KB, GROUP_K, FP8, FP32)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if FP8 and KB == 1:
        gate *= tl.load(sg_ptrs)[None, :]
        up *= tl.load(su_ptrs)[None, :]
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * stride_am + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                 N, K, stride_am, stride_we, stride_wn, stride_om, s_ptr, stride_se, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr,
                 FP8: tl.constexpr, KB: tl.constexpr, GROUP_K: tl.constexpr):
    """out[pair, n] = routing_weight[pair] * (act[pair] . W2[e, n]) for one row block (FP8: as
    _gate_up_kernel)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = s_ptr + expert * stride_se + tl.where(n_mask, offs_n, 0).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _scaled_dot(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), acc, s_ptrs, k0,
                          KB, GROUP_K, FP8, FP32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8 and KB == 1:
        acc *= tl.load(s_ptrs)[None, :]
    acc *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def default_config(num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile sizes from the token count only (a shape, never the routing). Small batches read each
    expert's weights for a row or two: small BLOCK_M wastes the least padding. float32 tiles take
    twice the shared memory: smaller N tiles and fewer stages (H200: 228 KB per SM)."""
    if num_tokens <= 32:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    elif num_tokens <= 512:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 64), BLOCK_K=64, num_stages=2)
    return cfg


def _check(x, w13, w2, topk_weights, topk_ids):
    m, h = x.shape
    e, two_i, h13 = w13.shape
    if (h13 != h or w2.shape != (e, h, two_i // 2) or two_i % 2 or topk_ids.shape != topk_weights.shape
            or topk_ids.dim() != 2 or topk_ids.shape[0] != m):
        raise ValueError(f"fused_moe shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)} [E, 2I, H], "
                         f"w2 {tuple(w2.shape)} [E, H, I], topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)} [M, top_k]")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1 or w13.stride(1) != h or w2.stride(1) != two_i // 2:
        raise ValueError("fused_moe needs contiguous rows in x and contiguous expert weights")


def fp8_tile_k(group_k: int, kb: int, block_k: int) -> int | None:
    """The K tile for FP8 experts: with block scales (kb > 1) a power of two dividing group_k (each
    tile inside one scale group), at most block_k and >= 16; None when there is none."""
    if kb == 1:
        return block_k
    tile = block_k
    while tile >= 16 and group_k % tile:
        tile //= 2
    return tile if tile >= 16 else None


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor) -> tuple:
    """(scale pointer, expert stride, row stride); without scales the weight stands in, never read."""
    if scale is None:
        return weight, 0, 0
    return scale, scale.stride(0), scale.stride(1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, group_k13: int = 0, group_k2: int = 0,
              skipped_pairs: bool = False, ordered_sum: bool = False) -> torch.Tensor:
    """x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [M, top_k]
    (float32), topk_ids [M, top_k] (int, in [0, E)). Returns sum_k w[m, k] * expert_k(x[m]), [M, H].
    FP8 experts (weight-only: activations stay in x's dtype): w13 / w2 float8_e4m3fn with float32
    scales w13_scale [E, 2I, ceil(H / group_k13)] and w2_scale [E, H, ceil(I / group_k2)], one row
    per output feature (quant/fp8_scheme.py). skipped_pairs: topk_ids may hold -1 (an expert another
    rank holds: expert parallel); those pairs are in no segment and add nothing. ordered_sum: a token's
    slots are added one after the other in float32 (slot 0 + slot 1 + ...), the same order whatever M
    (torch's reduction may pick its order by the tensor's shape)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()  # (read as flat pair arrays)
    fp8 = w13_scale is not None
    if fp8 and (w2_scale is None or w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn
                or w13_scale.shape[:2] != w13.shape[:2] or w2_scale.shape[:2] != w2.shape[:2]
                or w13_scale.shape[2] != -(-w13.shape[2] // group_k13)
                or w2_scale.shape[2] != -(-w2.shape[2] // group_k2)
                or w13_scale.stride(2) != 1 or w2_scale.stride(2) != 1):
        raise ValueError(f"fused_moe FP8: w13 {tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}, "
                         f"scales {None if w13_scale is None else tuple(w13_scale.shape)}, "
                         f"{None if w2_scale is None else tuple(w2_scale.shape)} (group_k {group_k13}, {group_k2})")
    m, h = x.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if m == 0:
        return torch.zeros_like(x)
    cfg = dict(default_config(m, x.dtype), **(config or {}))
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    bk13 = bk2 = bk
    if fp8:
        bk13, bk2 = fp8_tile_k(group_k13, w13_scale.shape[2], bk), fp8_tile_k(group_k2, w2_scale.shape[2], bk)
        if bk13 is None or bk2 is None:
            raise ValueError(f"fused_moe FP8: scale groups of {group_k13} and {group_k2} features need a "
                             "power-of-two divisor >= 16")
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, bm)
    num_pairs, fp32 = m * top_k, x.dtype == torch.float32
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    # (rows of skipped pairs are never written: zeros, for the slots' sum)
    out_k = (torch.zeros if skipped_pairs else torch.empty)((num_pairs, h), dtype=x.dtype, device=x.device)
    max_blocks = block_expert.shape[0]
    _gate_up_kernel[(max_blocks, triton.cdiv(inter, bn))](
        x, w13, act, sorted_ids, block_expert, num_padded, num_pairs, inter, h,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *_scale_args(w13_scale, w13),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk13, FP32=fp32, FP8=fp8,
        KB=w13_scale.shape[2] if fp8 else 1, GROUP_K=group_k13 or 1, **launch)
    _down_kernel[(max_blocks, triton.cdiv(h, bn))](
        act, w2, out_k, topk_weights.reshape(-1).float(), sorted_ids, block_expert, num_padded, num_pairs, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out_k.stride(0), *_scale_args(w2_scale, w2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk2, FP32=fp32, FP8=fp8, KB=w2_scale.shape[2] if fp8 else 1,
        GROUP_K=group_k2 or 1, **launch)
    slots = out_k.view(m, top_k, h)
    if not ordered_sum:
        return slots.sum(1, dtype=torch.float32).to(x.dtype)
    total = slots[:, 0].float()
    for k in range(1, top_k):
        total += slots[:, k]
    return total.to(x.dtype)
