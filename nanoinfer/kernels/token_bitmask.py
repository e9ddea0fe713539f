"""A grammar's packed token bitmask applied to some rows of the logits, in place, in Triton.

Bitmask row j (int32 words, bit t % 32 of word t // 32 allowing token t: xgrammar's layout) masks
logits row rows[j]: every disallowed column -> -inf, columns past the bitmask's vocabulary too
(padded embeddings). Grid (G, column tiles): a program reads its tile's words and stores -inf where
a bit is clear. The logits are never read, and nothing vocabulary-sized is allocated, so the cost is
the bitmask's bytes and the stores; the torch path (sampling/token_mask.py) unpacks [G, V] booleans
and gathers and scatters the rows.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per program: 128 words


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                                num_cols, num_bits, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + j).to(tl.int64)
    inside = cols < num_cols
    words = tl.load(bitmask_ptr + j.to(tl.int64) * bitmask_stride + cols // 32,
                    mask=inside & (cols < num_bits), other=0)
    allowed = (words >> (cols % 32)) & 1
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=inside & (allowed == 0))


def apply_token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[j], t] = -inf wherever bitmask row j disallows token t (in place). logits: [B, V]
    with unit column stride; rows: [G] ints; bitmask: [G, W] int32."""
    g, w = bitmask.shape
    if g == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "columns must be contiguous"
    grid = (g, triton.cdiv(logits.shape[1], BLOCK))
    _apply_token_bitmask_kernel[grid](logits, logits.stride(0), rows, bitmask, bitmask.stride(0),
                                      logits.shape[1], w * 32, BLOCK=BLOCK)
