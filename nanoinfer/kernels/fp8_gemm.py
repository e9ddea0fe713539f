"""W8A8 FP8 GEMM with scales in Triton (CUDA; the interpreter on CPU for tests), in the spirit of
vLLM's w8a8_block_fp8_matmul: y = (A * a_scale) @ (W * w_scale)^T, A float8 [M, K] with float32
a_scale [M, KA], W float8 [N, K] with float32 w_scale [N, KB], each scale column over GROUP_K input
features (KA is 1 for per-token or static activations, else KB).

With block scales (KB > 1) each BLOCK_K tile lies inside one group: its FP8 tensor-core product is
scaled by its group's scales and added to the float32 accumulator. With one scale column the scales
multiply the finished sum. The layer picks torch._scaled_mm instead for row-wise scales on sm90+
past a few rows; this kernel covers block scales, small M and the rest. No kernel is specialised on M."""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_ask, stride_wn,
                     stride_cm, KB: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = rk < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if KB == 1:
            acc = tl.dot(a, w, acc)
        else:
            group = k0 // GROUP_K
            sa = tl.load(as_ptr + rm * stride_asm + group * stride_ask, mask=m_mask, other=0.0)
            sw = tl.load(ws_ptr + rn * KB + group, mask=n_mask, other=0.0)
            acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if KB == 1:
        sa = tl.load(as_ptr + rm * stride_asm, mask=m_mask, other=0.0)
        sw = tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
        acc = acc * sa[:, None] * sw[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(group_k: int, kb: int) -> int | None:
    """The K tile: at most 128 and, with block scales, a power of two dividing group_k (>= 16 for the
    FP8 tensor-core dot); None when no such tile exists."""
    if kb == 1:
        return 128
    tile = 128
    while tile >= 16 and group_k % tile:
        tile //= 2
    return tile if tile >= 16 else None


def default_config(m: int, n: int, kb: int) -> dict:
    """Tiles by shape (never the data). Small M streams the weight: narrow column tiles so that
    there are enough programs to keep every SM reading. Large M with block scales keeps a second
    accumulator tile (each group's product is scaled before it is added), so its tiles are half the
    size of the row-wise ones, which would spill registers (vLLM's block-FP8 default is alike)."""
    if m <= 64:
        return dict(BLOCK_M=16 if m <= 16 else 64, BLOCK_N=32 if n <= 8192 else 64, num_warps=4, num_stages=4)
    if kb > 1:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, group_k: int,
             out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """a float8 [M, K], a_scale float32 [M, 1 or KB]; weight float8 [N, K], w_scale float32 [N, KB]
    (KB = ceil(K / group_k)). Returns [M, N] in out_dtype. Scales that no tile fits (block scales whose
    group_k has no power-of-two divisor >= 16) are refused."""
    m, k = a.shape
    n = weight.shape[0]
    kb = w_scale.shape[1]
    if weight.shape[1] != k or w_scale.shape != (n, -(-k // group_k)) or a_scale.shape[0] != m \
            or a_scale.shape[1] not in (1, kb):
        raise ValueError(f"fp8_gemm shapes: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, weight "
                         f"{tuple(weight.shape)}, w_scale {tuple(w_scale.shape)}, group_k {group_k}")
    if a.stride(1) != 1 or weight.stride(1) != 1 or not w_scale.is_contiguous():
        raise ValueError("fp8_gemm needs contiguous rows in a and weight, and contiguous w_scale")
    block_k = block_k_for(group_k, kb)
    if block_k is None:
        raise ValueError(f"fp8_gemm: block scales over group_k={group_k} features need a power-of-two divisor >= 16")
    cfg = dict(default_config(m, n, kb), BLOCK_K=block_k, **(config or {}))
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _fp8_gemm_kernel[grid](a, a_scale, weight, w_scale, c, m, n, k, a.stride(0), a_scale.stride(0),
                           a_scale.stride(1) if a_scale.shape[1] > 1 else 0, weight.stride(0), c.stride(0),
                           KB=kb, GROUP_K=group_k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                           BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c
