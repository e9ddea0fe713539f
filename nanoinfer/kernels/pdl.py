"""Programmatic dependent launch (NVIDIA Hopper and later, Triton >= 3.4): a kernel launched this way
may start while the kernel before it in the stream is still running. It calls gdc_wait() before
reading or writing anything the kernels before it touch (it may load what no kernel writes, such as
weights, earlier), and gdc_launch_dependents() only after that wait, to let the next such kernel
start. Decode at small batch is a chain of short kernels whose launch gaps are a large part of the
step; this overlaps them. NANOINFER_PDL=0 turns it off (for comparisons)."""
import functools
import os

import torch
import triton.language as tl


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("NANOINFER_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.hip is not None or not hasattr(tl.extra.cuda, "gdc_wait"):  # ROCm; Triton < 3.4
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter."""
    on = device.type == "cuda" and _enabled(device.index if device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
