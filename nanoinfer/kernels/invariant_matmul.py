"""y = x @ W^T (+ bias) whose every row is bitwise the same whatever the other rows: the GEMM of the
batch-invariant mode (nanoinfer/batch_invariant) on CUDA.

cuBLAS splits K across programs for few rows (and sums the partials), so a token's product alone
differs in its last bits from the same token's inside a larger step. Here an output element is
always one program's sum over all of K, the tensor-core dots chained through one float32
accumulator in order of K: no split-K. The tile shape does not change that order (each dot adds its
16-wide slices of K into the accumulator in turn, whatever BLOCK_M, BLOCK_N or BLOCK_K;
tests/test_invariant_matmul.py checks it bitwise), so the tiles may follow the number of rows
(`invariant_config`): narrow weight tiles for a few rows, where the weight's stream is the cost,
wide ones for prompts. M is never specialised on (Triton would compile another variant for M == 1
or M % 16 == 0).

The programs walk the output tiles in groups of GROUP_M row tiles (the weight tiles of a group stay
in L2 while its row tiles use them). Up to FEW_ROWS_MAX rows one program computes one tile, reading
through pointers; for more rows on Hopper, one persistent program per SM loops over the tiles and
reads them with the tensor memory accelerator (TMA), which keeps wide tiles fed: the same dots in
the same order, so the same bits (the tests compare both kernels).
"""
import functools

import torch
import triton
import triton.language as tl

try:  # (Triton 3.4 and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from nanoinfer.kernels.triton_attention import _num_sms

FEW_ROWS_MAX = 128


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program or tile `pid`, in groups of GROUP_M row tiles."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _store_tile(acc, b_ptr, y_ptr, M, N, stride_y, rm, rn, HAS_BIAS: tl.constexpr):
    """The tile's float32 sums (+ bias) rounded into y's rows rm and columns rn, within [M, N]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_y,
                             HAS_BIAS: tl.constexpr, FP32: tl.constexpr, EVEN_K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + rk) < K
            x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if FP32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    _store_tile(acc, b_ptr, y_ptr, M, N, stride_y, rm, rn, HAS_BIAS)


@triton.jit
def _tma_tile(x_desc, w_desc, b_ptr, y_ptr, M, N, K, stride_y, pid_m, pid_n, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        acc = tl.dot(x, w.T, acc)
    _store_tile(acc, b_ptr, y_ptr, M, N, stride_y, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                pid_n * BLOCK_N + tl.arange(0, BLOCK_N), HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _tma_persistent_kernel(x_desc, w_desc, b_ptr, y_ptr, M, N, K, stride_y, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tiles, NUM_PROGRAMS):  # (programs past the last tile do nothing)
        pid_m, pid_n = _tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _tma_tile(x_desc, w_desc, b_ptr, y_ptr, M, N, K, stride_y, pid_m, pid_n, HAS_BIAS, BLOCK_M, BLOCK_N,
                  BLOCK_K)


# (block_m, block_n, block_k, num_warps, num_stages). TUNED: (rows bucket, n, k) -> the fastest tiles
# that `python -m nanoinfer.bench.invariant_matmul --sweep --write` found for the bucket's largest
# row count on an H100 (Qwen3's weights; the pointer kernel's up to FEW_ROWS_MAX rows, the TMA
# kernel's past it); other shapes follow the rules below. Qwen3-0.6B's best at 16 and 64 rows are
# left out: the engine's decode steps ran slower with them than with _FEW_ROWS.
ROW_BUCKETS = (16, 64, FEW_ROWS_MAX, 256, 512, 1024, 2048)
TUNED: dict = {
    (16, 4096, 4096): (64, 32, 256, 4, 4),
    (16, 4096, 12288): (64, 32, 256, 4, 4),
    (16, 6144, 4096): (64, 64, 128, 4, 4),
    (16, 24576, 4096): (64, 64, 64, 4, 3),
    (16, 151936, 4096): (64, 64, 128, 4, 3),
    (64, 4096, 4096): (64, 32, 256, 4, 4),
    (64, 4096, 12288): (64, 32, 256, 4, 4),
    (64, 6144, 4096): (64, 64, 128, 4, 4),
    (64, 24576, 4096): (64, 64, 64, 4, 3),
    (64, 151936, 4096): (64, 64, 128, 4, 3),
    (128, 1024, 2048): (64, 16, 128, 4, 4),
    (128, 1024, 3072): (64, 16, 128, 4, 4),
    (128, 4096, 1024): (64, 64, 128, 4, 4),
    (128, 4096, 4096): (64, 64, 128, 4, 4),
    (128, 4096, 12288): (64, 64, 256, 4, 3),
    (128, 6144, 1024): (64, 64, 64, 4, 4),
    (128, 6144, 4096): (64, 32, 128, 4, 3),
    (128, 24576, 4096): (64, 64, 64, 4, 4),
    (128, 151936, 1024): (64, 64, 64, 4, 3),
    (128, 151936, 4096): (64, 64, 128, 4, 3),
    (256, 1024, 2048): (64, 32, 128, 4, 4),
    (256, 1024, 3072): (64, 32, 128, 4, 4),
    (256, 4096, 1024): (64, 128, 64, 4, 5),
    (256, 4096, 4096): (64, 128, 64, 4, 5),
    (256, 4096, 12288): (64, 128, 64, 4, 5),
    (256, 6144, 1024): (128, 128, 64, 4, 4),
    (256, 6144, 4096): (128, 128, 128, 8, 3),
    (256, 24576, 4096): (128, 128, 128, 8, 3),
    (256, 151936, 1024): (128, 256, 64, 8, 3),
    (256, 151936, 4096): (128, 256, 64, 8, 3),
    (512, 1024, 2048): (64, 64, 128, 4, 4),
    (512, 1024, 3072): (64, 64, 128, 4, 4),
    (512, 4096, 1024): (128, 128, 64, 4, 4),
    (512, 4096, 4096): (128, 128, 64, 4, 4),
    (512, 4096, 12288): (128, 128, 64, 4, 4),
    (512, 6144, 1024): (128, 256, 64, 8, 3),
    (512, 6144, 4096): (128, 256, 64, 8, 3),
    (512, 24576, 4096): (128, 256, 64, 8, 3),
    (512, 151936, 1024): (128, 256, 64, 8, 3),
    (512, 151936, 4096): (128, 256, 64, 8, 3),
    (1024, 1024, 2048): (64, 128, 64, 4, 5),
    (1024, 1024, 3072): (64, 128, 64, 4, 5),
    (1024, 4096, 1024): (128, 256, 64, 8, 3),
    (1024, 4096, 4096): (128, 256, 64, 8, 3),
    (1024, 4096, 12288): (128, 256, 64, 8, 3),
    (1024, 6144, 1024): (128, 128, 64, 8, 4),
    (1024, 6144, 4096): (128, 128, 64, 4, 4),
    (1024, 24576, 4096): (128, 256, 64, 8, 3),
    (2048, 1024, 2048): (128, 128, 64, 4, 4),
    (2048, 1024, 3072): (128, 128, 64, 8, 4),
    (2048, 4096, 1024): (128, 256, 64, 8, 3),
    (2048, 4096, 4096): (128, 256, 64, 8, 3),
    (2048, 4096, 12288): (128, 128, 64, 8, 4),
    (2048, 6144, 1024): (128, 256, 64, 8, 3),
    (2048, 6144, 4096): (128, 256, 64, 8, 3),
    (2048, 24576, 4096): (128, 256, 64, 8, 3),
}
_FEW_ROWS = (64, 32, 128, 4, 4)
_BY_WIDTH = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (64, 32, 128, 4, 4))


def _as_config(tiles: tuple) -> dict:
    return dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), tiles), group_m=8)


def rows_bucket(m: int) -> int:
    """TUNED's row bucket of m rows: the first of ROW_BUCKETS holding them, else the last."""
    return next((b for b in ROW_BUCKETS if m <= b), ROW_BUCKETS[-1])


def invariant_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int = 132) -> dict:
    """The tiles for m rows of an [n, k] weight: the tuned ones of the shape and row bucket, else for
    up to FEW_ROWS_MAX rows narrow weight tiles (the weight's stream is the cost), else the widest
    tiles that still give every SM a program (nanoinfer.bench.invariant_matmul measured them on an H100)."""
    if dtype == torch.float32:
        return _as_config((32, 32, 32, 4, 2))
    tuned = TUNED.get((rows_bucket(m), n, k))
    if tuned is not None:
        return _as_config(tuned)
    if m <= FEW_ROWS_MAX:
        return _as_config(_FEW_ROWS)
    for tiles in _BY_WIDTH:
        if triton.cdiv(m, tiles[0]) * triton.cdiv(n, tiles[1]) >= num_sms:
            return _as_config(tiles)
    return _as_config(_BY_WIDTH[-1])


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _takes_tma(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TMA kernel can read x and weight: 16-bit values on a Hopper or newer GPU, rows and
    bases 16-byte aligned (what a tensor descriptor needs)."""
    return (TensorDescriptor is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[1] % 8 == 0 and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and _has_tma(x.device))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype (into `out`, [M, N] with
    contiguous rows, when given). `config`: tiles other than invariant_config's (benchmarks)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    m, k = x.shape
    n = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or invariant_config(m, n, k, x.dtype, _num_sms(x.device))
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    if m > FEW_ROWS_MAX and _takes_tma(x, weight):
        programs = _num_sms(x.device)  # (one per SM whatever M: one compiled variant)
        _tma_persistent_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [cfg["block_m"], cfg["block_k"]]),
            TensorDescriptor.from_tensor(weight, [cfg["block_n"], cfg["block_k"]]),
            bias if bias is not None else x, out, m, n, k, out.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"],
            NUM_PROGRAMS=programs, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out, m, n, k, out.stride(0), HAS_BIAS=bias is not None,
        FP32=x.dtype == torch.float32, EVEN_K=k % cfg["block_k"] == 0, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out
