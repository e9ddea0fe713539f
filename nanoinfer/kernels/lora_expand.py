"""The LoRA expand with its slot selection in one Triton kernel (CUDA; the interpreter on CPU for
tests): y[m] += t[m, slot block of m] @ B[:, slot block of m]^T for each row m whose slot is >= 0,
where t = x @ A^T is the shrink over every slot (lora/linear.py's layout: slot s owns columns
[s * W, (s + 1) * W) of t and of B). It replaces the torch path's mask multiply and addmm.

Each program takes BLOCK_M rows and BLOCK_N output features, and for each slot that one of its rows
uses, multiplies those rows' W-wide block of t by that slot's B tile (other rows load zeros): a
slot no row of the block uses costs nothing, so a long prompt's block touches one slot's B. Partial
sums stay in float32 and are added to y once, rounded once (as addmm); a row of slot -1 gets
y + 0 exactly. CUDA-graph safe: the grid comes from the shapes, no host sync, and the kernel is
not specialised on the number of rows."""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _lora_expand_kernel(t_ptr, b_ptr, slots_ptr, y_ptr, o_ptr, M, N, stride_t, stride_b, stride_y, stride_o,
                        S: tl.constexpr, W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(S):
        mine = row_ok & (slot == s)
        if tl.sum(mine.to(tl.int32), 0) > 0:
            for w0 in tl.static_range(0, W, BLOCK_W):
                ws = s * W + w0 + tl.arange(0, BLOCK_W)
                w_ok = w0 + tl.arange(0, BLOCK_W) < W
                t = tl.load(t_ptr + rows[:, None] * stride_t + ws[None, :], mask=mine[:, None] & w_ok[None, :],
                            other=0.0)
                b = tl.load(b_ptr + cols[:, None] * stride_b + ws[None, :], mask=col_ok[:, None] & w_ok[None, :],
                            other=0.0)
                acc += tl.dot(t, tl.trans(b), input_precision="ieee")
    ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=ok, other=0.0)
    tl.store(o_ptr + rows[:, None] * stride_o + cols[None, :], (y.to(tl.float32) + acc).to(y.dtype), mask=ok)


def lora_expand(t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, num_slots: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y + each row's slot block of t times that slot's block of b (t: [M, S * W], b: [N, S * W],
    slots: [M] int, -1 for none, y: [M, N], rows strided, columns contiguous), written into `out`
    ([M, N], columns contiguous) or, without it, into y in place; returns what it wrote."""
    out = y if out is None else out
    rows, n = y.shape
    width = t.shape[1] // num_slots
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 64
    block_n = 64
    block_w = min(64, max(16, triton.next_power_of_2(width)))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](t, b, slots, y, out, rows, n, t.stride(0), b.stride(0), y.stride(0), out.stride(0),
                              S=num_slots, W=width, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w)
    return out
