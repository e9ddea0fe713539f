"""A grammar's packed token bitmask applied to logits on the device (the pipeline's GRAMMAR stage).

Rows are int32 words, bit j of word i allowing token 32 * i + j (xgrammar's layout). The words are
read as little-endian bytes (as on x86, ARM and CUDA) and unpacked with shifts: plain torch, so
the same code runs on CPU and CUDA, batched over the constrained rows. A logits row wider than the
bitmask (padded vocabulary) has its extra columns disallowed.
"""
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[G, W] int32 words -> [G, width] bool, True where the token is allowed."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    g, w = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8)                  # [G, 4W], little-endian
    allowed = ((as_bytes[:, :, None] >> shifts) & 1).view(g, w * 32).bool()
    if w * 32 >= width:
        return allowed[:, :width]
    return torch.cat([allowed, allowed.new_zeros(g, width - w * 32)], dim=1)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[j], token] = -inf wherever bitmask row j disallows the token (in place)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
