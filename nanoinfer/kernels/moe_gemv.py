"""Mixture-of-experts for a handful of tokens (decode at small batch), and the routing for any
number: three Triton kernels (CUDA; the interpreter on CPU for tests) where the grouped-GEMM path
(kernels/fused_moe.py) runs about a dozen small kernels a layer.

1. route_topk: per token, softmax over the router logits, its top_k experts (largest first, ties
   to the lower index) and their weights, renormalised to sum to 1 when asked; float32, as
   layers/fused_moe.py select_experts computes them. One program a token.
2. moe_gemv, gate_up: one program per (token, slot) pair and BLOCK_N intermediate features:
   x[token] . W13[e] for the gate and the up rows on CUDA cores, silu(gate) * up rounded once to
   x's dtype (as the grouped kernel's `act`).
3. moe_gemv, down: one program per token and BLOCK_N output features walks the token's top_k
   experts: each slot's act . W2[e], times its routing weight, rounded to x's dtype (as the
   grouped kernel's per-slot rows), summed in float32 over the slots, rounded once. So the slots'
   sum needs no kernel of its own, and no sort, padding or expert grouping is needed at all.

At a few tokens the grouped path's tiles are mostly padding and its sort, its launches and its
final sum cost more than the weight bytes; past a few tokens two tokens often share an expert,
which this path reads once per pair, so the grouped path takes over (layers/fused_moe.py
GEMV_MAX_TOKENS). Weights as fused_moe takes them: w13 [E, 2I, H] (gate rows, then up rows),
w2 [E, H, I], contiguous; no FP8 experts here.
"""
import torch
import triton
import triton.language as tl


# ------------------------------------------------------------------------------------------ routing
@triton.jit
def _route_kernel(logits_ptr, stride_l, weights_ptr, ids_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    valid = offs < E
    logits = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, 0)
    left = tl.where(valid, p, -1.0)  # (taken experts become -1)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), tl.float32)
    ids = tl.zeros((K_PAD,), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, offs, E_PAD), 0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx, ids)
        left = tl.where(offs == idx, -1.0, left)
    if RENORM:
        weights = weights / tl.sum(tl.where(slots < TOP_K, weights, 0.0), 0)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] (any float dtype, last dim contiguous) -> (weights float32 [M, top_k],
    ids int32 [M, top_k]), largest first."""
    m, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"route_topk: logits {tuple(router_logits.shape)} with a contiguous last dim and "
                         f"1 <= top_k <= {num_experts}, got top_k={top_k}")
    weights = torch.empty((m, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=router_logits.device)
    if m:
        _route_kernel[(m,)](router_logits, router_logits.stride(0), weights, ids, E=num_experts,
                            E_PAD=triton.next_power_of_2(num_experts), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize, num_warps=1)
    return weights, ids


# ------------------------------------------------------------------------------------------ experts
@triton.jit
def _pair_gate_up_kernel(x_ptr, stride_xm, w_ptr, ids_ptr, act_ptr, stride_am, N, K: tl.constexpr,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pair = tl.program_id(0), tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    # (-1: another rank's expert, expert parallel: no weight read, act 0)
    live_n = tl.where(expert >= 0, N, 0)
    expert = tl.maximum(expert, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    g_rows = w_ptr + expert * (2 * N * K) + rn.to(tl.int64)[:, None] * K
    u_rows = g_rows + N * K
    gate = tl.zeros((BLOCK_N,), tl.float32)
    up = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_ptr + token * stride_xm + rk, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = (rn < live_n)[:, None] & k_mask[None, :]
        gate += tl.sum(tl.load(g_rows + rk[None, :], mask=w_mask, other=0.0).to(tl.float32) * x[None, :], 1)
        up += tl.sum(tl.load(u_rows + rk[None, :], mask=w_mask, other=0.0).to(tl.float32) * x[None, :], 1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair * stride_am + rn, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _token_down_kernel(act_ptr, stride_am, w_ptr, ids_ptr, weights_ptr, out_ptr, stride_om, N, K: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, token = tl.program_id(0), tl.program_id(1)
    DTYPE = out_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        live_n = tl.where(expert >= 0, N, 0)  # (as in _pair_gate_up_kernel: a skipped pair adds 0)
        rows = w_ptr + tl.maximum(expert, 0) * (N * K) + rn.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            a = tl.load(act_ptr + pair * stride_am + rk, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(rows + rk[None, :], mask=(rn < live_n)[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], 1)
        total += (acc * tl.load(weights_ptr + pair)).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + token * stride_om + rn, total.to(DTYPE), mask=n_mask)


def default_config(hidden: int, inter: int) -> dict:
    """Tiles of the two expert kernels, those of the dense GEMV (kernels/gemv.py default_config, swept
    on the H200): four output features a program, so that one token's pairs spread over the SMs,
    K tiles up to 1024 wide."""
    def tiles(k):
        return dict(BLOCK_N=4, BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4 if k >= 4096 else 8,
                    num_stages=2)
    return dict(gate_up=tiles(hidden), down=tiles(inter))


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """sum_k topk_weights[m, k] * expert_{topk_ids[m, k]}(x[m]), [M, H], as kernels/fused_moe.py
    fused_moe computes it (same shapes and roundings): x [M, H] with contiguous rows, w13 [E, 2I, H],
    w2 [E, H, I] contiguous, topk_weights float32 [M, top_k], topk_ids int [M, top_k] in [0, E), or
    -1 for a pair another rank computes (expert parallel): it adds nothing."""
    m, h = x.shape
    num_experts, two_i, h13 = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if (h13 != h or w2.shape != (num_experts, h, inter) or two_i % 2 or topk_ids.shape != topk_weights.shape
            or topk_ids.shape[0] != m or x.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous()):
        raise ValueError(f"moe_gemv shapes: x {tuple(x.shape)} (contiguous rows), w13 {tuple(w13.shape)} [E, 2I, H], "
                         f"w2 {tuple(w2.shape)} [E, H, I] (both contiguous), topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)} [M, top_k]")
    out = torch.empty_like(x)
    if m == 0:
        return out
    cfg = config or default_config(h, inter)
    gu, dn = dict(cfg["gate_up"]), dict(cfg["down"])
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous().float()
    act = torch.empty((m * top_k, inter), dtype=x.dtype, device=x.device)
    _pair_gate_up_kernel[(triton.cdiv(inter, gu["BLOCK_N"]), m * top_k)](
        x, x.stride(0), w13, ids, act, act.stride(0), inter, K=h, TOP_K=top_k, **gu)
    _token_down_kernel[(triton.cdiv(h, dn["BLOCK_N"]), m)](
        act, act.stride(0), w2, ids, weights, out, out.stride(0), h, K=inter, TOP_K=top_k, **dn)
    return out
