"""A packed token bitmask applied to logits, in place (the GRAMMAR stage: grammar.py).

Rows are int32 words, bit j of word i allowing token 32 * i + j (xgrammar's layout). On CUDA a
Triton kernel stores -inf where a bit is clear (kernels/token_bitmask.py). Elsewhere (CPU) each
constrained row adds, in place, a 0 / -inf row looked up byte by byte from a 256-entry table: no
[G, V] boolean mask, no gather and scatter of the rows. The words are read as little-endian bytes
(as on x86 and ARM). A logits row wider than the bitmask (padded vocabulary) has its extra columns
disallowed.
"""
import torch

from nanoinfer.kernels.token_bitmask import apply_token_bitmask_triton

_ADD: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry [b, k] is 0 where bit k of byte b is set (allowed), else -inf."""
    table = _ADD.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _ADD[(device, dtype)] = torch.where(bits.bool(), 0.0, float("-inf")).to(device, dtype)
    return table


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[j], token] = -inf wherever bitmask row j disallows the token (in place)."""
    if logits.is_cuda:

        apply_token_bitmask_triton(logits, rows, bitmask)
        return
    width = logits.shape[1]
    bits = bitmask.shape[1] * 32
    table = _byte_table(logits.device, logits.dtype)
    as_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int32)  # [G, 4W], little-endian
    for j, r in enumerate(rows.tolist()):
        row = logits[r]
        # (x + 0 is x, a zero's sign aside; x + -inf is -inf, so allowed logits keep their values)
        row[:min(width, bits)].add_(table[as_bytes[j]].view(-1)[:width])
        if width > bits:
            row[bits:] = float("-inf")
