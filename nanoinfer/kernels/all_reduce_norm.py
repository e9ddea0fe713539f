"""The tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it (CUDA).

Each rank's row-parallel projection writes its partial sums into its own symmetric-memory buffer
(layers/all_reduce.py); this kernel then waits until every rank has done so, reads all the ranks'
buffers over NVLink (peer loads, no multicast), sums them in rank order (so every rank computes the
same bits), rounds the sum to the model's dtype as an all-reduce would, adds the residual and
normalises, with the roundings of kernels/norm_act.py. One kernel instead of three (copy into the
buffer, PyTorch's one-shot all-reduce, the norm), and with more programs than PyTorch's kernel
uses, so the peer loads keep NVLink busy.

The wait is a barrier between program p of every rank: p bumps its own counter, stores it into its
slot of every peer's flags (a release at system scope: the partial sums, written by the kernel
before, are visible first), then its first warp waits until every peer's slot in its own flags has
reached it (an acquire; the program's barrier orders the other warps' reads after it). Counters
are 64-bit, so they never wrap. A rank can be at most one all-reduce ahead of a peer (it cannot
finish this one before the peer has arrived), so a buffer is never rewritten while a peer reads
it: each site has its own buffer and the next write to it is two barriers away. Two fused calls in
a row on one site (with no other all-reduce between) would break that; every model here alternates
sites (attention, then MLP). A call runs one program per ROWS rows, up to PROGRAMS: the count
depends on the rows alone, so it is the same on every rank, and program p's counter counts the
calls it took part in on every rank alike. Program p waits only for program p of its peers, which
starts once the programs numbered below it have been dispatched (GPUs dispatch in order; on an
H200 all 128 are resident at once). Fewer programs for fewer rows: at one row, a barrier over all
128 cost more than PyTorch's one-shot all-reduce.
"""
import os

import torch
import triton
import triton.language as tl

PROGRAMS = 128  # programs per call at most (the barrier pairs program p with p)
MAX_TILE = 8192  # elements a program holds at once (rows x features)


@triton.jit
def _wait_at_least(flag, count):
    """Spin until *flag >= count, with acquire loads at system scope: in PTX, since Triton's
    loads carry no memory order. Only the first warp spins (its threads' loads of one word are one
    request); the caller's barrier holds the other warps."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p, q;
        .reg .s64 v;
        .reg .u32 t;
        mov.u32 t, %tid.x;
        setp.ge.u32 q, t, 32;
        @q bra done${:uid};
        spin${:uid}:
        ld.acquire.sys.global.b64 v, [$1];
        setp.lt.s64 p, v, $2;
        @p bra spin${:uid};
        done${:uid}:
        mov.u32 $0, 0;
        }""", "=r,l,l", [flag, count], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _all_reduce_norm_kernel(buffer_ptrs, flag_ptrs, counter_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                            n_rows, eps, RANK: tl.constexpr, WORLD: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
                            N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr,
                            INTERPRET: tl.constexpr):
    DTYPE = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    count = tl.load(counter_ptr + pid) + 1
    tl.store(counter_ptr + pid, count)
    for r in tl.static_range(WORLD):  # "my partial sums are ready", into every peer's flags
        if r != RANK:
            flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags + RANK * MAX_PROGRAMS + pid, count, sem="release", scope="sys")
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (loaded while the peers arrive)
    own = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int64))
    for r in tl.static_range(WORLD):
        if r != RANK:
            slot = own + r * MAX_PROGRAMS + pid  # rank r's signal for this program
            if INTERPRET:  # (programs run one by one there: a peer's signal must be there already)
                if tl.load(slot) < count:
                    raise RuntimeError(f"rank {r} has not signalled")
            else:
                _wait_at_least(slot, count)
    tl.debug_barrier()  # every warp reads after the first warp's acquire

    # ROWS rows at once: their peer loads are in flight together (NVLink latency, not bandwidth,
    # bounds a program's rows)
    for first in range(pid * ROWS, n_rows, programs * ROWS):
        rows = first + tl.arange(0, ROWS)
        m = (rows < n_rows)[:, None] & mask[None, :]
        at = rows[:, None] * N + offs[None, :]  # (a buffer holds at most BUFFER_BYTES: no 32-bit overflow)
        acc = tl.zeros((ROWS, BLOCK), tl.float32)
        for r in tl.static_range(WORLD):
            buf = tl.load(buffer_ptrs + r).to(tl.pointer_type(DTYPE))
            acc += tl.load(buf + at, mask=m, other=0.0).to(tl.float32)
        x = acc.to(DTYPE).to(tl.float32)  # the all-reduced value, in the model's dtype
        if HAS_RES:
            x += tl.load(res_ptr + at, mask=m, other=0.0).to(tl.float32)
            tl.store(res_out_ptr + at, x.to(DTYPE), mask=m)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
        y = (x * rstd[:, None]).to(DTYPE).to(tl.float32)
        tl.store(out_ptr + at, (w[None, :] * y).to(DTYPE), mask=m)


def rows_and_programs(n: int, features: int) -> tuple[int, int]:
    """Rows a program sums at once, and the programs of a call over n rows (the same on every rank)."""
    rows = min(triton.next_power_of_2(triton.cdiv(n, PROGRAMS)), max(1, MAX_TILE // triton.next_power_of_2(features)))
    return rows, min(PROGRAMS, triton.cdiv(n, rows))


def all_reduce_norm(buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, counters: torch.Tensor, rank: int,
                    n: int, features: int, dtype: torch.dtype, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Sum rows [0, n) of every rank's buffer ([rows, features] of `dtype`, addresses in
    `buffer_ptrs`, an int64 tensor), then (with a residual, [n, features] contiguous) add it and
    normalise. `flag_ptrs`: every rank's int64 flags, [world, PROGRAMS] each, zero at first;
    `counters`: this rank's int64 [PROGRAMS], zero at first. Returns weight * norm(sum), or that and
    sum + residual, as norm_act.rms_norm does."""
    if residual is not None and (residual.shape != (n, features) or not residual.is_contiguous()):
        raise ValueError(f"all_reduce_norm: residual must be contiguous [{n}, {features}], got {tuple(residual.shape)}")
    world = buffer_ptrs.shape[0]
    out = torch.empty((n, features), dtype=dtype, device=weight.device)
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(features)
    rows, programs = rows_and_programs(n, features)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    _all_reduce_norm_kernel[(programs,)](
        buffer_ptrs, flag_ptrs, counters, out if residual is None else residual, weight, out, res_out, n, eps,
        RANK=rank, WORLD=world, MAX_PROGRAMS=PROGRAMS, N=features, BLOCK=block, ROWS=rows,
        HAS_RES=residual is not None, INTERPRET=interpret,
        num_warps=min(max(rows * block // 512, 1), 8))  # (16 elements a thread)
    return out if residual is None else (out, res_out)
