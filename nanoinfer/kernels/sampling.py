"""Temperature + Gumbel-max sampling fused in Triton: each logit is read once, all math in fp32
registers, no vocabulary-sized buffer.

A sampled row's token is argmax(x / T - log E), E ~ Exp(1) per entry (a sample of softmax(x / T));
a greedy row (T < SAMPLING_EPS) takes argmax(x). Ties go to the smallest index. A row with a NaN
or +inf logit, or with no logit above -inf, gives NON_FINITE (-1), as the pipeline's torch path
does: the engine fails that request rather than sample from a broken row.

Grid (B, num_chunks): a program scans one chunk of its row's vocabulary tile by tile, keeping a
per-lane running (max, index) in registers, and reduces it once at the end; a tiny kernel then picks
each row's best chunk. The number of chunks comes from shapes only (no host sync), enough programs to
fill the SMs.

Noise: Philox-4x32-10 (tl.randint4x), four 32-bit words per call, one for each quarter of a tile.
Key = the per-call seed; counter = (row << 32) + tile * quarter + lane: every row has its own stream,
no counter can overflow whatever B * V, and the noise depends on (seed, row, column) only, not on the
batch size or the chunking. The kernel is bound by Philox and the logarithms, not by memory.

With tensor parallelism each rank holds a shard of the vocabulary's logits: gumbel_argmax_partials
scans a shard over the full row's tiles (so every column gets the same noise as in the full row),
the ranks exchange their rows' per-chunk (max, index), a few bytes a row, and pick_token then takes
the token sample_gumbel_argmax takes on the whole row.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoinfer.kernels.triton_attention import _num_sms
from nanoinfer.sampling_params import SAMPLING_EPS

_EPS = tl.constexpr(SAMPLING_EPS)
_INT_MAX = tl.constexpr(2**31 - 1)
NON_FINITE = -1  # the token of a row whose logits hold a NaN or +inf


@triton.jit
def _log(x, FAST: tl.constexpr):
    if FAST:  # lg2.approx: precise logf would be most of the kernel's math
        return libdevice.fast_logf(x)
    else:  # the interpreter has no libdevice
        return tl.log(x)


@triton.jit
def _log_exponential(r, FAST: tl.constexpr):
    """log E, E ~ Exp(1), from 32 random bits. E = -log(1 - W), W uniform in (0, 1): for small W
    (large Gumbel noise, where a rare token can win) E ~= W keeps all 32 bits of resolution, which
    -log(U) of a float U near 1 (steps of 2^-24) would lose."""
    w = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # / 2^32
    w = tl.minimum(w, 0.99999994)  # r near 2^32 rounds to 1.0
    e = tl.where(w < 0.0078125, w * (1.0 + w * (0.5 + w * 0.33333334)), -_log(1.0 - w, FAST))
    return _log(e, FAST)


@triton.jit
def _keep_max(best_v, best_i, v, cols):
    # strict: a lane sees its columns in increasing order, so ties keep the smaller index
    better = v > best_v
    return tl.where(better, v, best_v), tl.where(better, cols, best_i)


@triton.jit
def _in_shard(c, col0, end, SHARD: tl.constexpr):
    if SHARD:
        return (c >= col0) & (c < end)
    else:
        return c < end


# The seed changes every step and the chunking with the batch size: never specialised on (==1, %16),
# which would JIT-compile a new variant in the middle of serving.
@triton.jit(do_not_specialize=["seed", "tiles_per_chunk", "col0", "first_tile", "part_stride"])
def _sample_kernel(logits_ptr, temp_ptr, out_ptr, part_v_ptr, part_i_ptr, stride_b, V, col0, first_tile,
                   part_stride, seed, seed_ptr, tiles_per_chunk, QUARTER: tl.constexpr, FAST_LOG: tl.constexpr,
                   SHARD: tl.constexpr, SEED_PTR: tl.constexpr):
    """SHARD: the logits are columns [col0, col0 + V) of the vocabulary (a tensor-parallel rank's
    shard); the tiles are the full row's, so each column gets the noise it gets in the full row.
    The program then always writes its (max, index) to the partials. SEED_PTR: the seed is read
    from seed_ptr (a CUDA graph's buffer, written before each replay) instead of `seed`."""
    row = tl.program_id(0)
    if SEED_PTR:
        seed = tl.load(seed_ptr)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    t = tl.load(temp_ptr + row)
    sampled = t >= _EPS
    inv_t = 1.0 / tl.where(sampled, t, 1.0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_b - col0  # column c of the vocabulary at row_ptr + c
    end = col0 + V
    ctr_row = row.to(tl.int64) << 32
    offs = tl.arange(0, QUARTER)

    best_v = tl.full([QUARTER], float("-inf"), tl.float32)
    best_i = tl.zeros([QUARTER], tl.int32)  # (a chunk of -inf alone reports index 0 at -inf)
    broken = tl.zeros([QUARTER], tl.int32)  # a lane saw a NaN or +inf logit
    t_start = first_tile + chunk * tiles_per_chunk
    t_end = tl.minimum(t_start + tiles_per_chunk, tl.cdiv(end, 4 * QUARTER))
    for tile in range(t_start, t_end):
        c0 = tile * (4 * QUARTER) + offs
        c1 = c0 + QUARTER
        c2 = c1 + QUARTER
        c3 = c2 + QUARTER
        x0 = tl.load(row_ptr + c0, mask=_in_shard(c0, col0, end, SHARD), other=float("-inf")).to(tl.float32)
        x1 = tl.load(row_ptr + c1, mask=_in_shard(c1, col0, end, SHARD), other=float("-inf")).to(tl.float32)
        x2 = tl.load(row_ptr + c2, mask=_in_shard(c2, col0, end, SHARD), other=float("-inf")).to(tl.float32)
        x3 = tl.load(row_ptr + c3, mask=_in_shard(c3, col0, end, SHARD), other=float("-inf")).to(tl.float32)
        broken |= ((x0 != x0) | (x0 == float("inf")) | (x1 != x1) | (x1 == float("inf"))).to(tl.int32)
        broken |= ((x2 != x2) | (x2 == float("inf")) | (x3 != x3) | (x3 == float("inf"))).to(tl.int32)
        if sampled:
            r0, r1, r2, r3 = tl.randint4x(seed, ctr_row + (tile * QUARTER + offs))
            x0 = x0 * inv_t - _log_exponential(r0, FAST_LOG)
            x1 = x1 * inv_t - _log_exponential(r1, FAST_LOG)
            x2 = x2 * inv_t - _log_exponential(r2, FAST_LOG)
            x3 = x3 * inv_t - _log_exponential(r3, FAST_LOG)
        best_v, best_i = _keep_max(best_v, best_i, x0, c0)
        best_v, best_i = _keep_max(best_v, best_i, x1, c1)
        best_v, best_i = _keep_max(best_v, best_i, x2, c2)
        best_v, best_i = _keep_max(best_v, best_i, x3, c3)

    m = tl.max(best_v, 0)
    idx = tl.min(tl.where(best_v == m, best_i, _INT_MAX), 0)
    bad = tl.max(broken, 0) > 0  # then +inf at index -1: it wins every pick, across chunks and ranks
    m = tl.where(bad, float("inf"), m)
    idx = tl.where(bad, -1, idx)
    if SHARD:
        tl.store(part_v_ptr + row * part_stride + chunk, m)
        tl.store(part_i_ptr + row * part_stride + chunk, idx)
    elif num_chunks == 1:
        tl.store(out_ptr + row, tl.where(m == float("-inf"), -1, idx).to(tl.int64))  # (no finite logit)
    else:
        tl.store(part_v_ptr + row * part_stride + chunk, m)
        tl.store(part_i_ptr + row * part_stride + chunk, idx)


@triton.jit(do_not_specialize=["num_chunks", "part_stride", "rank_stride"])
def _pick_chunk_kernel(part_v_ptr, part_i_ptr, out_ptr, num_chunks, part_stride, rank_stride,
                       RANKS: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    """A row's token: the largest of its chunks' maxima (each rank's, for shards), the smallest
    index among equal ones. Indices are the vocabulary's, so the order of the entries is free."""
    row = tl.program_id(0)
    offs = tl.arange(0, MAX_CHUNKS)
    mask = offs < num_chunks
    m = tl.full([], float("-inf"), tl.float32)
    idx = tl.full([], _INT_MAX, tl.int32)
    for r in tl.static_range(RANKS):
        at = r * rank_stride + row * part_stride + offs
        v = tl.load(part_v_ptr + at, mask=mask, other=float("-inf"))
        i = tl.load(part_i_ptr + at, mask=mask, other=_INT_MAX)
        mr = tl.max(v, 0)
        ir = tl.min(tl.where(v == mr, i, _INT_MAX), 0)
        take = (mr > m) | ((mr == m) & (ir < idx))
        m, idx = tl.where(take, mr, m), tl.where(take, ir, idx)
    tl.store(out_ptr + row, tl.where(m == float("-inf"), -1, idx).to(tl.int64))  # (no finite logit)


# Tunables. A tile is 4 * quarter logits; programs_per_sm: programs (B * chunks) per SM aimed for.
# shard_programs: the same for a vocabulary shard, as a count (4 a SM on an H200's 132 SMs): the
# partials' shape must not depend on the GPU, since the ranks exchange them.
SAMPLE_CFG = {"quarter": 1024, "num_warps": 8, "programs_per_sm": 4, "max_chunks": 64, "shard_programs": 528}
_INTERPRET_CFG = {"quarter": 32, "num_warps": 1, "programs_per_sm": 4, "max_chunks": 64, "shard_programs": 528}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv costs microseconds per call on the host: this runs every step


def sample_num_chunks(batch: int, num_tiles: int, num_sms: int, programs_per_sm: int,
                      max_chunks: int) -> tuple[int, int]:
    """(num_chunks, tiles_per_chunk) from shapes only: enough programs to fill the SMs, no empty chunk."""
    chunks = min(num_tiles, max_chunks, max(1, _cdiv(num_sms * programs_per_sm, batch)))
    per_chunk = _cdiv(num_tiles, chunks)
    return _cdiv(num_tiles, per_chunk), per_chunk


def _config(device: torch.device, config: dict | None) -> dict:
    base = SAMPLE_CFG if device.type == "cuda" else _INTERPRET_CFG  # interpreter: small tiles, quick tests
    return dict(base, **(config or {}))


def _max_chunks(cfg: dict) -> int:
    return 1 << (cfg["max_chunks"] - 1).bit_length()  # the pick kernel's width: fixed, one variant


def sample_gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seed: "int | torch.Tensor",
                         config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] bf16/fp16/fp32 (last dim contiguous, any row stride); temperatures [B] float32
    (rows < SAMPLING_EPS are greedy); seed in [0, 2^31), or a one-element int64 device tensor
    holding it (read by the kernel: what a CUDA graph replays with a new seed). Returns the token
    ids [B] int64 on the logits' device (in `out` if given). Enqueue-only: no host sync."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (B,) and temperatures.dtype == torch.float32
    seed_ptr = isinstance(seed, torch.Tensor)
    assert (seed.dtype == torch.int64 and seed.numel() == 1) if seed_ptr else 0 <= seed < 2**31
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    assert out.shape == (B,) and out.dtype == torch.int64 and out.is_contiguous()
    if B == 0:
        return out
    cfg = _config(logits.device, config)
    quarter = cfg["quarter"]
    num_chunks, tiles_per_chunk = sample_num_chunks(B, _cdiv(V, 4 * quarter), _num_sms(logits.device),
                                                    cfg["programs_per_sm"], cfg["max_chunks"])
    # allocated even when unused (one chunk): a pointer of another dtype would compile another variant
    part_v = torch.empty((B, num_chunks), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((B, num_chunks), dtype=torch.int32, device=logits.device)
    _sample_kernel[(B, num_chunks)](logits, temperatures, out, part_v, part_i, logits.stride(0), V, 0, 0,
                                    num_chunks, 0 if seed_ptr else seed, seed if seed_ptr else out,
                                    tiles_per_chunk, QUARTER=quarter,
                                    FAST_LOG=logits.is_cuda and torch.version.hip is None,  # NVIDIA libdevice
                                    SHARD=False, SEED_PTR=seed_ptr, num_warps=cfg["num_warps"])
    if num_chunks > 1:
        _pick_chunk_kernel[(B,)](part_v, part_i, out, num_chunks, num_chunks, 0, RANKS=1,
                                 MAX_CHUNKS=_max_chunks(cfg), num_warps=1)
    return out


def gumbel_argmax_partials(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, col0: int,
                           config: dict | None = None) -> torch.Tensor:
    """sample_gumbel_argmax's first half on a tensor-parallel rank's shard of the vocabulary:
    `logits` [B, V] are columns [col0, col0 + V) of each row. Returns every row's per-chunk maxima
    and their vocabulary indices as int32 [B, 2, chunks] (the maxima as float32 bits, then the
    indices), a shape that depends on (B, V) and the config alone, so that the ranks can exchange
    them; then pick_token takes from them the token sample_gumbel_argmax takes on the whole row."""
    B, V = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (B,) and temperatures.dtype == torch.float32
    assert 0 <= seed < 2**31 and col0 >= 0
    cfg = _config(logits.device, config)
    quarter = cfg["quarter"]
    tile = 4 * quarter
    span = _cdiv(V, tile) + 1  # the most tiles any V columns overlap, so the same on every rank
    num_chunks, tiles_per_chunk = sample_num_chunks(max(B, 1), span, cfg["shard_programs"], 1, cfg["max_chunks"])
    parts = torch.empty((B, 2, num_chunks), dtype=torch.int32, device=logits.device)
    if B == 0:
        return parts
    # (a chunk past this shard's last tile finds no column: it reports -inf at index 0, which any
    # finite logit beats, and which an all -inf row takes, as on the whole row)
    _sample_kernel[(B, num_chunks)](logits, temperatures, parts, parts.view(torch.float32)[:, 0], parts[:, 1],
                                    logits.stride(0), V, col0, col0 // tile, 2 * num_chunks, seed, parts,
                                    tiles_per_chunk, QUARTER=quarter,
                                    FAST_LOG=logits.is_cuda and torch.version.hip is None,
                                    SHARD=True, SEED_PTR=False, num_warps=cfg["num_warps"])
    return parts


def pick_token(parts: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """`parts`: every rank's gumbel_argmax_partials, stacked [ranks, B, 2, chunks]. Returns each
    row's token [B] int64: the largest maximum, the smallest index among equal ones."""
    R, B, _, num_chunks = parts.shape
    cfg = _config(parts.device, config)
    assert parts.is_contiguous() and num_chunks <= _max_chunks(cfg)
    out = torch.empty(B, dtype=torch.int64, device=parts.device)
    if B:
        _pick_chunk_kernel[(B,)](parts.view(torch.float32)[:, :, 0], parts[:, :, 1], out, num_chunks,
                                 2 * num_chunks, B * 2 * num_chunks, RANKS=R, MAX_CHUNKS=_max_chunks(cfg),
                                 num_warps=1)
    return out
